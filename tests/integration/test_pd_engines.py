"""P/D on two real built-in engines in one process (real transfer agents over loopback TCP): greedy
output equals a colocated engine token for token; blocks are released on both sides afterwards.

The HTTP/router path is covered by test_pd_cluster.py; this file isolates the connector + agent +
engine seams (chunked prefill on P, preemption on D, aborts, failures) and runs in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvwire.connector.config import LoadFailurePolicy
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import KVTransferParams, Role
from kvwire.transfer.config import ControlLimits, TransferConfig
from kvwire.transfer.enums import Backend
from support.pd_engine_helpers import (
    BLOCK,
    FIRST,
    GREEDY,
    MAX_LEN,
    MAX_TOKENS,
    NO_ADMISSION_WAIT,
    PD,
    engine_config,
)

LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, MAX_LEN - MAX_TOKENS - 1]


def prompts(n: int = 24) -> list[list[int]]:
    return [[(7 * j + 13 * i) % 250 + 1 for j in range(LENGTHS[i % len(LENGTHS)])] for i in range(n)]






def colocated(config: EngineConfig, all_prompts: list[list[int]]) -> dict[int, list[int]]:
    engine = LLMEngine(config)
    for i, prompt in enumerate(all_prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    out: dict[int, list[int]] = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for o in engine.step():
            if o.finished:
                out[int(o.request_id[1:])] = o.token_ids
    engine.close()
    return out


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    return colocated(engine_config(), prompts())


@pytest.fixture
def pd() -> Iterator[PD]:
    # P: chunked prefill (64-token steps); D: a cache small enough that 24 requests preempt.
    pair = PD(
        p_config=engine_config(max_num_batched_tokens=64),
        d_config=engine_config(num_kv_blocks=20),
    )
    yield pair
    pair.close()


def assert_all_freed(pd: PD) -> None:
    pd.run(timeout_s=10.0)
    for engine in (pd.p, pd.d):
        stats = engine.stats()
        assert stats.kv_blocks_in_use == 0, stats
        assert stats.num_delayed_free_requests == 0, stats
        assert engine.scheduler_connector.num_tracked_requests == 0  # type: ignore[attr-defined]
        assert engine.worker_connector.num_live_transfers == 0  # type: ignore[attr-defined]


def test_push_equals_colocated(pd: PD, reference: dict[int, list[int]]) -> None:
    for i, prompt in enumerate(prompts()):
        pd.add_push(f"r{i}", prompt)
    pd.run()
    for i in range(len(prompts())):
        out = pd.results[f"r{i}"]
        assert out.error is None and out.finish_reason == "length", out
        assert out.token_ids == reference[i], f"prompt {i} ({len(prompts()[i])} tokens)"
        assert pd.results[f"p-r{i}"].token_ids == reference[i][:1]
    assert pd.d.stats().num_prompt_tokens < sum(len(p) for p in prompts())  # D did not prefill all
    assert pd.d.stats().num_kv_load_failures == 0
    assert pd.d.stats().num_preemptions > 0  # D's small cache forced recompute-preemptions
    # on one host every layer went in one copy: into D's shared cache, or, for offers that came
    # before D's request was scheduled, into D's receive buffers (shared too)
    shm = pd.p.worker_connector.agent._planes.members[Backend.SHM]  # type: ignore[attr-defined]
    assert shm.layers_sent["one_copy"] > 0 and shm.layers_sent["ring"] == 0, shm.layers_sent
    assert_all_freed(pd)


def test_pull_equals_colocated(pd: PD, reference: dict[int, list[int]]) -> None:
    all_prompts = prompts()
    for i, prompt in enumerate(all_prompts):
        pd.add_pull_p(f"r{i}", prompt)
    pd.run(until=lambda: all(f"p-r{i}" in pd.results for i in range(len(all_prompts))))
    for i, prompt in enumerate(all_prompts):
        params = pd.results[f"p-r{i}"].kv_transfer_params
        assert params is not None and params["first_token_id"] == reference[i][0]
        pd.d.add_request(f"r{i}", prompt, GREEDY, params)
    pd.run()
    for i in range(len(all_prompts)):
        assert pd.results[f"r{i}"].token_ids == reference[i], f"prompt {i}"
    assert pd.d.stats().num_kv_load_failures == 0
    # on one host, D pulls into its own blocks: P wrote them in one copy into D's shared cache
    shm = pd.p.worker_connector.agent._planes.members[Backend.SHM]  # type: ignore[attr-defined]
    assert shm.layers_sent["one_copy"] > 0, shm.layers_sent
    assert_all_freed(pd)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_push_equals_colocated_with_quantized_weights(quantization: str) -> None:
    """The quantized CPU modes on both sides: D's output is the colocated engine's, token for token.

    Both prefill every prompt whole and D has room for every request: these layers take bfloat16
    activations, so a difference in the last bits of an fp32 input (chunks cut at other places, a
    preempted request recomputed) can round to a different bfloat16 and change a later greedy
    token. The kernels themselves give each row the same result whatever the batch (test_quant.py)."""
    all_prompts = prompts(12)
    config = engine_config(quantization=quantization)
    expected = colocated(config, all_prompts)
    pair = PD(p_config=config, d_config=engine_config(quantization=quantization))
    try:
        assert type(pair.d.model.head).__name__ == f"Int{quantization[-1]}Linear"
        for i, prompt in enumerate(all_prompts):
            pair.add_push(f"r{i}", prompt)
        pair.run()
        for i in range(len(all_prompts)):
            assert pair.results[f"r{i}"].token_ids == expected[i], f"prompt {i}"
        assert pair.d.stats().num_prompt_tokens < sum(len(p) for p in all_prompts)  # the KV came from P
        assert pair.d.stats().num_kv_load_failures == 0
        assert_all_freed(pair)
    finally:
        pair.close()


def test_aborts_at_any_moment_release_blocks(pd: PD) -> None:
    all_prompts = prompts(12)
    for i, prompt in enumerate(all_prompts):
        pd.add_push(f"r{i}", prompt)
    for n in range(8):  # abort pairs at different moments of the handover
        pd.step()
        pd.d.abort_request(f"r{n}")
        pd.p.abort_request(f"p-r{n + 1}")
    pd.run()
    assert pd.results["r0"].finish_reason == "abort"
    assert_all_freed(pd)


def test_p_lost_d_recomputes_within_deadline(reference: dict[int, list[int]]) -> None:
    pair = PD(p_config=engine_config(), d_config=engine_config(), deadline_s=0.5,
              transfer=NO_ADMISSION_WAIT)
    try:
        all_prompts = prompts(6)
        for i, prompt in enumerate(all_prompts):
            pair.add_push(f"r{i}", prompt, to_p=False)  # P never computes: the KV never comes
        start = time.monotonic()
        pair.run(timeout_s=20)
        assert time.monotonic() - start < 10
        for i in range(len(all_prompts)):
            assert pair.results[f"r{i}"].token_ids == reference[i]
        assert pair.d.stats().num_kv_load_failures == len(all_prompts)
        assert_all_freed(pair)
    finally:
        pair.close()


def test_p_lost_policy_fail_gives_clear_error() -> None:
    pair = PD(
        p_config=engine_config(),
        d_config=engine_config(kv_load_failure_policy="fail"),
        deadline_s=0.3,
        policy=LoadFailurePolicy.FAIL,
        transfer=NO_ADMISSION_WAIT,
    )
    try:
        pair.add_push("r0", [1, 2, 3], to_p=False)
        pair.run(timeout_s=20)
        out = pair.results["r0"]
        assert out.finish_reason == "error" and "remote KV load failed" in (out.error or "")
        assert_all_freed(pair)
    finally:
        pair.close()


def test_d_closed_p_frees_within_deadline() -> None:
    pair = PD(p_config=engine_config(), d_config=engine_config(), deadline_s=1.0)
    try:
        d_endpoint = pair.endpoints(pair.d)
        pair.d.close()  # D's agent is gone before P sends
        params = KVTransferParams(
            transfer_id="t-dead", role=Role.PREFILL, deadline_s=1.0, peer_endpoints=d_endpoint
        )
        pair.p.add_request("p-r0", list(range(1, 40)), FIRST, params.to_dict())
        start = time.monotonic()
        while pair.p.has_unfinished_requests() and time.monotonic() - start < 10:
            pair.p.step()
            time.sleep(0.001)
        assert time.monotonic() - start < 5
        assert pair.p.stats().kv_blocks_in_use == 0
        assert pair.p.stats().num_delayed_free_requests == 0
    finally:
        pair.p.close()


def test_a_request_withdrawn_after_the_engine_took_it_frees_p_blocks() -> None:
    """The HTTP server's admission was cancelled just as the engine took the request (decision 146):
    the request is aborted and its params withdrawn, which aborts its send at once. Here P's prefill
    ran first: the request ended, its blocks held for the send, whose layers P's next step hands
    over (CPU caches, decision 147) together with the withdrawal's abort. The blocks are freed then,
    not held for ever (decision 156); the transfer's deadline is far off."""
    pair = PD(p_config=engine_config(), d_config=engine_config(), deadline_s=30.0)
    try:
        sched, worker = pair.p.scheduler_connector, pair.p.worker_connector
        sched.promise_now, sched.withdraw_now = worker.promise_now, worker.withdraw_now  # type: ignore[attr-defined]
        raw = KVTransferParams(transfer_id="t-withdrawn", role=Role.PREFILL, deadline_s=30.0,
                               peer_endpoints=pair.endpoints(pair.d))
        params = sched.check_request_params(raw.to_dict())  # type: ignore[attr-defined]
        pair.p.add_request("p-r0", list(range(1, 40)), FIRST, params.to_dict())
        outputs = pair.p.step()  # the whole prefill: the request ends, its blocks wait for the send
        assert [o.finished for o in outputs] == [True] and pair.p.stats().num_delayed_free_requests == 1
        sched.withdraw_request_params(params, "not admitted: CancelledError")  # type: ignore[attr-defined]
        pair.p.abort_request("p-r0")  # (over already)
        start = time.monotonic()
        while pair.p.has_unfinished_requests() and time.monotonic() - start < 10:
            pair.p.step()
            time.sleep(0.001)
        assert pair.p.stats().kv_blocks_in_use == 0
        assert pair.p.stats().num_delayed_free_requests == 0
        assert sched.num_tracked_requests == 0  # type: ignore[attr-defined]
    finally:
        pair.close()


def test_an_offer_d_never_expects_frees_p_blocks_at_the_unsolicited_bound(
    reference: dict[int, list[int]],
) -> None:
    """D's request never reached its engine (the client went away first): P's Offer, parked on D
    (every Offer is past a 1-byte cap), was renewed both ways up to the transfer's limit, P's blocks
    held that long. D now drops it ``max_unsolicited_wait_s`` after its arrival and P's send fails,
    freeing the blocks, though every lease (60 s) runs on (decision 159). The request reaching D after
    that recomputes (its expect raises at once) and completes."""
    limits = ControlLimits(max_unexpected_bytes_per_peer=1, max_unsolicited_wait_s=1.0)
    pair = PD(p_config=engine_config(), d_config=engine_config(), deadline_s=60.0,
              transfer=TransferConfig(limits=limits))  # fmt: skip
    try:
        prompt = prompts(1)[0]
        params = KVTransferParams(transfer_id="t-unclaimed", role=Role.PREFILL, deadline_s=60.0,
                                  peer_endpoints=pair.endpoints(pair.d))  # fmt: skip
        pair.p.add_request("p-r0", prompt, FIRST, params.to_dict())
        outputs = pair.p.step()  # the whole prefill: the request ends, its blocks wait for the send
        assert [o.finished for o in outputs] == [True] and pair.p.stats().num_delayed_free_requests == 1
        start = time.monotonic()
        while pair.p.has_unfinished_requests() and time.monotonic() - start < 30:
            pair.p.step()
            time.sleep(0.001)
        assert pair.p.stats().kv_blocks_in_use == 0 and pair.p.stats().num_delayed_free_requests == 0
        d_agent = pair.d.worker_connector.agent  # type: ignore[attr-defined]
        assert d_agent.stats().limits_hit == {"unexpected_bytes_per_peer": 1, "unsolicited_wait": 1}
        assert pair.p.worker_connector.agent.stats().failed == {"peer_aborted": 1}  # type: ignore[attr-defined]
        late = KVTransferParams(transfer_id="t-unclaimed", role=Role.DECODE, deadline_s=60.0,
                                peer_endpoints=pair.endpoints(pair.p))  # fmt: skip
        pair.d.add_request("r0", prompt, GREEDY, late.to_dict())
        pair.run(timeout_s=30)
        assert pair.results["r0"].token_ids == reference[0]
        assert pair.d.stats().num_kv_load_failures == 1
        assert_all_freed(pair)
    finally:
        pair.close()
