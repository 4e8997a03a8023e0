"""Batching, chunked prefill, preemption and prefix caching never change greedy outputs (fp32)."""

from __future__ import annotations

import pytest

from kvwire.engine import AttentionBackend, SamplingParams
from support.engine_factories import generate, greedy, make_engine, random_prompts, run_all

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


def test_admission_counts_free_cached_blocks_it_takes() -> None:
    # 6 blocks of 4. A leaves 4 cached (free) blocks; C holds the 2 others; B's prefix hits A's 4
    # blocks and needs 1 more: it must wait for C instead of taking the cached blocks and failing.
    engine = make_engine(num_kv_blocks=6, block_size=4)
    a = random_prompts(1, 17, 17, seed=11)[0]
    b = [*a[:16], 70, 71]
    generate(engine, [a], greedy(1))
    engine.add_request("c", [256, 1, 2, 3, 4], greedy(3))  # admitted first, in the same step
    engine.add_request("b", b, greedy(4))
    final = run_all(engine)
    assert final["b"].token_ids == generate(make_engine(enable_prefix_caching=False), [b], greedy(4))[0]
    assert final["b"].num_cached_tokens == 16 and len(final["c"].token_ids) == 3


def test_max_model_len_never_exceeds_the_kv_cache() -> None:
    engine = make_engine(num_kv_blocks=4, block_size=8)
    assert engine.max_model_len == 32
    engine.add_request("r", random_prompts(1, 20, 20)[0], greedy(100))
    out = run_all(engine)["r"]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
