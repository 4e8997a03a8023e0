"""P/D on two real built-in engines in one process (real transfer agents over loopback TCP): greedy
output equals a colocated engine token for token; blocks are released on both sides afterwards.

The HTTP/router path is covered by test_pd_cluster.py; this file isolates the connector + agent +
engine seams (chunked prefill on P, preemption on D, aborts, failures) and runs in seconds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
from kvwire.connector.factory import build_connectors
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.sampling_params import SamplingParams
from kvwire.kv_params import KVTransferParams, Role, TransferMode

BLOCK = 16
MAX_LEN = 256
MAX_TOKENS = 8
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, MAX_LEN - MAX_TOKENS - 1]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompts(n: int = 24) -> list[list[int]]:
    return [[(7 * j + 13 * i) % 250 + 1 for j in range(LENGTHS[i % len(LENGTHS)])] for i in range(n)]


def engine_config(**overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(model="tiny", block_size=BLOCK, max_model_len=MAX_LEN, num_kv_blocks=256)
    base.update(overrides)
    return EngineConfig(**base)


class PD:
    """A prefill engine and a decode engine joined by the kvwire connector, stepped in turn."""

    def __init__(
        self,
        *,
        p_config: EngineConfig,
        d_config: EngineConfig,
        deadline_s: float = 30.0,
        policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE,
    ) -> None:
        def pair(role: Role, config: EngineConfig) -> LLMEngine:
            cc = ConnectorConfig(
                role=role, deadline_s=deadline_s, lease_s=deadline_s, kv_load_failure_policy=policy
            )
            sched, worker = build_connectors(cc, EngineInfo(block_size=BLOCK), registry=CollectorRegistry())
            return LLMEngine(config, sched, worker)

        self.p = pair(Role.PREFILL, p_config)
        self.d = pair(Role.DECODE, d_config)
        self.deadline_s = deadline_s
        self.results: dict[str, Any] = {}

    def endpoints(self, engine: LLMEngine) -> list[str]:
        return list(engine.scheduler_connector.kv_endpoints)  # type: ignore[attr-defined]

    def add_push(self, rid: str, prompt: list[int], *, to_p: bool = True) -> str:
        tid = uuid.uuid4().hex
        if to_p:
            p_params = KVTransferParams(
                transfer_id=tid,
                role=Role.PREFILL,
                deadline_s=self.deadline_s,
                peer_endpoints=self.endpoints(self.d),
            )
            self.p.add_request("p-" + rid, prompt, FIRST, p_params.to_dict())
        d_params = KVTransferParams(
            transfer_id=tid,
            role=Role.DECODE,
            deadline_s=self.deadline_s,
            peer_endpoints=self.endpoints(self.p),
        )
        self.d.add_request(rid, prompt, GREEDY, d_params.to_dict())
        return tid

    def add_pull_p(self, rid: str, prompt: list[int]) -> None:
        params = KVTransferParams(
            transfer_id=uuid.uuid4().hex,
            mode=TransferMode.PULL,
            role=Role.PREFILL,
            deadline_s=self.deadline_s,
        )
        self.p.add_request("p-" + rid, prompt, FIRST, params.to_dict())

    def step(self) -> None:
        for out in self.p.step():
            if out.finished:
                self.results["p-" + out.request_id[2:]] = out
        for out in self.d.step():
            if out.finished:
                self.results[out.request_id] = out

    def run(self, timeout_s: float = 60.0, until: Any = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if until is not None and until():
                return
            if until is None and not (self.p.has_unfinished_requests() or self.d.has_unfinished_requests()):
                return
            self.step()
            time.sleep(0.0005)
        raise AssertionError("P/D engines did not finish before the deadline")

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    engine = LLMEngine(engine_config())
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"r{i}", prompt, GREEDY)
    out: dict[int, list[int]] = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for o in engine.step():
            if o.finished:
                out[int(o.request_id[1:])] = o.token_ids
    engine.close()
    return out


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
    assert_all_freed(pd)


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
    pair = PD(p_config=engine_config(), d_config=engine_config(), deadline_s=0.5)
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
