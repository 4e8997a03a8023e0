"""Partial transfers (KV-aware routing) on two real built-in engines: when D already holds a prefix of
the prompt (``kv_transfer_params.skip_blocks``), P sends only the blocks after it, and the output
equals a colocated engine token for token: cold, warm P, warm D, both warm, and D evicted mid-way
(it drops the transfer and prefills locally). Also: D alone prefilling a short suffix from its cache
(the router's skipped prefill) equals colocated.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import KVTransferParams, Role
from support.pd_engine_helpers import BLOCK, FIRST, GREEDY, PD, engine_config

TURN1 = [(5 * j) % 250 + 1 for j in range(6 * BLOCK + 4)]  # 100 tokens: 6 full blocks
TURN2 = TURN1 + [(11 * j) % 250 + 3 for j in range(3 * BLOCK + 7)]  # the next turn extends it
SKIP = len(TURN1) // BLOCK  # what a router that saw D's KV events would ask for


@pytest.fixture(scope="module")
def reference() -> list[int]:
    engine = LLMEngine(engine_config(enable_prefix_caching=False))
    engine.add_request("ref", TURN2, GREEDY)
    deadline = time.monotonic() + 60
    out: list[int] = []
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for o in engine.step():
            if o.finished:
                out = o.token_ids
    engine.close()
    assert out
    return out


@pytest.fixture
def pd() -> Iterator[PD]:
    pair = PD(p_config=engine_config(), d_config=engine_config(num_kv_blocks=64))
    yield pair
    pair.close()


def warm(pd: PD, engine: LLMEngine, name: str) -> None:
    """Run TURN1 locally on ``engine`` (no kv_transfer_params), leaving its blocks cached."""
    engine.add_request(name, TURN1, GREEDY)
    pd.run()


def push(pd: PD, rid: str, prompt: list[int], skip_blocks: int) -> None:
    tid = uuid.uuid4().hex
    p_params = KVTransferParams(transfer_id=tid, role=Role.PREFILL, peer_endpoints=pd.endpoints(pd.d),
                                skip_blocks=skip_blocks)
    d_params = KVTransferParams(transfer_id=tid, role=Role.DECODE, peer_endpoints=pd.endpoints(pd.p),
                                skip_blocks=skip_blocks)
    pd.p.add_request("p-" + rid, prompt, FIRST, p_params.to_dict())
    pd.d.add_request(rid, prompt, GREEDY, d_params.to_dict())


def sent_bytes(engine: LLMEngine) -> int:
    return engine.worker_connector.agent.stats().bytes_sent  # type: ignore[attr-defined]


def run_until_sent(pd: PD) -> None:
    """Both engines idle and P's sends acknowledged (D can finish before P hears its last ack)."""
    pd.run(until=lambda: not (pd.p.has_unfinished_requests() or pd.d.has_unfinished_requests())
           and pd.p.stats().num_delayed_free_requests == 0)


CASES = {  # name -> (warm P, warm D, skip_blocks the router asks for, evict D's tail before admission)
    "cold": (False, False, 0, False),
    "warm-p": (True, False, 0, False),
    "warm-d": (False, True, SKIP, False),
    "both-warm": (True, True, SKIP, False),
    "evicted-mid-way": (False, True, SKIP, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_partial_transfer_equals_colocated(pd: PD, reference: list[int], case: str) -> None:
    warm_p, warm_d, skip, evict = CASES[case]
    if warm_p:
        warm(pd, pd.p, "p-warm")
    if warm_d:
        warm(pd, pd.d, "warm")
    if evict:  # D loses the tail of the prefix after the router looked (another request needed blocks)
        cached = pd.d.blocks.find_cached_blocks(TURN2)
        assert len(cached) >= SKIP
        pd.d.blocks.invalidate(cached[SKIP // 2 :])
    before = sent_bytes(pd.p)
    push(pd, "r", TURN2, skip)
    pd.run()
    out = pd.results["r"]
    assert out.error is None and out.finish_reason == "length", out
    assert out.token_ids == reference, case
    assert pd.results["p-r"].token_ids == reference[:1]
    moved = sent_bytes(pd.p) - before
    if evict:
        # D no longer held the prefix: it dropped the transfer and prefilled the prompt itself
        assert pd.d.stats().num_prompt_tokens >= len(TURN2) - BLOCK * (SKIP // 2)
    else:
        assert moved > 0  # the KV came from P (byte counts of partial payloads: the next test)
        if skip:  # D computed no prompt token beyond turn 1's warm-up: the rest came from P
            assert pd.d.stats().num_prompt_tokens <= len(TURN1)
    assert pd.d.stats().num_kv_load_failures == 0
    pd.run(timeout_s=10.0)
    for engine in (pd.p, pd.d):
        assert engine.stats().kv_blocks_in_use == 0
        assert engine.scheduler_connector.num_tracked_requests == 0  # type: ignore[attr-defined]


def test_partial_transfer_moves_fewer_bytes(pd: PD) -> None:
    """Warm D: P's payload is the prompt's blocks minus the prefix D holds, to the byte."""
    push(pd, "cold", TURN2, 0)
    run_until_sent(pd)
    cold = sent_bytes(pd.p)
    warm(pd, pd.d, "warm")
    push(pd, "partial", TURN2, SKIP)
    run_until_sent(pd)
    partial = sent_bytes(pd.p) - cold
    blocks_total = -(-len(TURN2) // BLOCK)
    assert partial * blocks_total == cold * (blocks_total - SKIP)


def test_decode_alone_prefills_suffix_from_its_cache(pd: PD, reference: list[int]) -> None:
    """The router's skipped prefill: D gets the plain request and computes only the new tokens."""
    warm(pd, pd.d, "warm")
    computed_before = pd.d.stats().num_prompt_tokens
    pd.d.add_request("r", TURN2, GREEDY)
    pd.run()
    assert pd.results["r"].token_ids == reference
    assert pd.d.stats().num_prompt_tokens - computed_before <= len(TURN2) - SKIP * BLOCK
