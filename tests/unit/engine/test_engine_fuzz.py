"""Randomised schedule: small cache (preemption), chunking, shared prefixes (prefix cache), aborts at
random times. Every request ends exactly once, blocks all come back, and greedy outputs of requests
that were not aborted equal their output alone."""

from __future__ import annotations

import random

import pytest
from engine_factories import generate, greedy, make_engine, random_prompts

from kvwire.engine import RequestOutput


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
