"""Randomised schedule: small cache (preemption), chunking, shared prefixes (prefix cache), aborts at
random times. Every request ends exactly once, blocks all come back, and greedy outputs of requests
that were not aborted equal their output alone."""

from __future__ import annotations

import random

import pytest

from kvwire.connector.base import ConnectorOutput
from kvwire.engine import RequestOutput
from support.engine_factories import generate, greedy, make_engine, random_prompts
from support.engine_fake_connectors import (
    Calls,
    DecodeScheduler,
    DecodeWorker,
    RecordingWorker,
    Wire,
    prefill,
)


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_random_schedule_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    shared = random_prompts(1, 24, 24, seed=seed)[0]
    prompts = [
        (shared if rng.random() < 0.5 else [256]) + random_prompts(1, 2, 40, seed=100 * seed + i)[0][1:]
        for i in range(12)
    ]
    max_tokens = [rng.randint(1, 10) for _ in prompts]
    engine = make_engine(num_kv_blocks=20, block_size=4, max_num_batched_tokens=24, max_num_seqs=5)
    final: dict[str, RequestOutput] = {}
    pending = list(range(len(prompts)))
    aborted: set[str] = set()
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], greedy(max_tokens[i]))
        added = len(prompts) - len(pending)
        if added and rng.random() < 0.1:
            victim = f"r{rng.randrange(added)}"  # maybe finished already: then ignored
            aborted.add(victim)
            engine.abort_request(victim)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
        if not pending and not engine.has_unfinished_requests():
            break
    assert len(final) == len(prompts)
    stats = engine.stats()
    assert stats.kv_blocks_in_use == 0
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_tokens > 0  # the schedule exercised both
    assert any(o.finish_reason == "abort" for o in final.values())
    alone = make_engine(enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        out = final[f"r{i}"]
        if out.finish_reason == "abort":
            assert out.request_id in aborted
            continue
        assert out.token_ids == generate(alone, [prompt], greedy(max_tokens[i]))[0]


class FlakyDecodeWorker(DecodeWorker):
    """Delivers each request's remote KV after a random number of steps, or fails it."""

    def __init__(self, calls: Calls, wire: Wire, scheduler: DecodeScheduler, rng: random.Random) -> None:
        super().__init__(calls, wire, scheduler, 16)
        self.rng = rng
        self.gone: set[str] = set()

    def get_finished(self, finished_req_ids: set[str]) -> ConnectorOutput:
        RecordingWorker.get_finished(self, finished_req_ids)
        pending = sorted(set(self.scheduler.allocated) - self.loaded - finished_req_ids - self.gone)
        self.gone |= finished_req_ids  # aborted: its blocks may already belong to someone else
        ready, failed = set(), {}
        for request_id in pending:
            roll = self.rng.random()
            if roll < 0.15:
                failed[request_id] = "injected failure"
                self.loaded.add(request_id)
            elif roll < 0.5:
                self._scatter(request_id)
                ready.add(request_id)
        return ConnectorOutput(finished_recving=frozenset(ready), failed=failed)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_remote_kv_arrivals_failures_and_aborts(seed: int) -> None:
    rng = random.Random(seed)
    prompts = random_prompts(10, 5, 60, seed=seed)
    expected = generate(make_engine(), prompts, greedy(6))
    wire = Wire()
    prefill(wire, prompts)
    calls = Calls()
    sched = DecodeScheduler(calls, wire, load_async=True, use_first_token=rng.random() < 0.5)
    worker = FlakyDecodeWorker(calls, wire, sched, rng)
    engine = make_engine(scheduler_connector=sched, worker_connector=worker, num_kv_blocks=24)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(6))
    final: dict[str, RequestOutput] = {}
    for _ in range(500):
        if rng.random() < 0.05:
            engine.abort_request(f"r{rng.randrange(len(prompts))}")
        final.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert len(final) == len(prompts) and engine.stats().kv_blocks_in_use == 0
    assert engine.stats().num_kv_load_failures > 0
    for i in range(len(prompts)):
        out = final[f"r{i}"]
        assert out.finish_reason in ("abort", "length")
        if out.finish_reason == "length":
            assert out.token_ids == expected[i]
