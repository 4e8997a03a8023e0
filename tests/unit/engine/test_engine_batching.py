"""Batching, chunked prefill, preemption and prefix caching never change greedy outputs (fp32)."""

from __future__ import annotations

import pytest
from engine_factories import generate, greedy, make_engine, random_prompts

from kvwire.engine import AttentionBackend, SamplingParams

PROMPTS = random_prompts(6, 3, 70, seed=1)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt run by itself on the reference attention path: the oracle."""
    engine = make_engine(attention_backend=AttentionBackend.REFERENCE, enable_prefix_caching=False)
    return [generate(engine, [p], greedy(MAX_TOKENS))[0] for p in PROMPTS]


@pytest.mark.parametrize("backend", [AttentionBackend.REFERENCE, AttentionBackend.SDPA])
def test_mixed_batch_equals_each_prompt_alone(alone: list[list[int]], backend: AttentionBackend) -> None:
    engine = make_engine(attention_backend=backend)
    assert generate(engine, PROMPTS, greedy(MAX_TOKENS)) == alone
    assert engine.stats().kv_blocks_in_use == 0


def test_outputs_differ_between_prompts(alone: list[list[int]]) -> None:
    # Guards the tests above: the tiny model's output depends on its prompt.
    assert len({tuple(t) for t in alone}) == len(alone)


def test_chunked_prefill_does_not_change_outputs(alone: list[list[int]]) -> None:
    engine = make_engine(max_num_batched_tokens=16, block_size=8)
    assert generate(engine, PROMPTS, greedy(MAX_TOKENS)) == alone
    assert engine.stats().num_steps > max(len(p) for p in PROMPTS) // 16


def test_preemption_recomputes_without_changing_outputs(alone: list[list[int]]) -> None:
    # 14 blocks of 8 tokens: the longest request alone needs 11, so others are preempted.
    engine = make_engine(num_kv_blocks=14, block_size=8, enable_prefix_caching=False)
    assert generate(engine, PROMPTS, greedy(MAX_TOKENS)) == alone
    assert engine.stats().num_preemptions > 0
    assert engine.stats().kv_blocks_in_use == 0


def test_prefix_cache_hits_do_not_change_outputs() -> None:
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + [65 + i] * (i + 1) for i in range(3)]
    cold = [generate(make_engine(enable_prefix_caching=False), [p], greedy(8))[0] for p in prompts]
    engine = make_engine(block_size=8)
    warm = [generate(engine, [p], greedy(8))[0] for p in prompts]  # one after the other: later ones hit
    assert warm == cold
    assert engine.stats().num_prefix_cache_hit_tokens >= 2 * 40 // 8 * 8


def test_max_num_seqs_limits_the_running_batch() -> None:
    engine = make_engine(max_num_seqs=2)
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 2
