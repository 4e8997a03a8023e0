"""The scheduler module: the block manager (reference counts, prefix cache, the used-block count
kept as a field) and what the scheduler reads every step as plain fields."""

from __future__ import annotations

import random

import pytest

from kvwire.engine.llm_engine import Request
from kvwire.engine.model_runner import SamplingParams
from kvwire.engine.scheduler import BlockManager, ScheduledRequest
from kvwire.tokenizer import ByteTokenizer, IncrementalDetokenizer


def test_allocate_and_free_track_reference_counts() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = bm.allocate(3)
    assert bm.num_free_blocks == 1 and len(set(a)) == 3
    with pytest.raises(MemoryError):
        bm.allocate(2)
    bm.free(a)
    assert bm.num_free_blocks == 4
    with pytest.raises(AssertionError):
        bm.free(a[:1])  # freed twice


def test_prefix_cache_shares_full_computed_blocks_only() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # two full blocks + 2 tokens
    blocks = bm.allocate(3)
    bm.cache_blocks(tokens, blocks, num_computed_tokens=10)
    assert bm.find_cached_blocks([*tokens, 99]) == blocks[:2]
    assert bm.find_cached_blocks(tokens[:8]) == blocks[:1]  # at least one token is left to compute
    assert bm.find_cached_blocks([1, *tokens[1:]]) == []  # hashes chain over the whole prefix
    bm.take(blocks[:2])  # a second request shares them
    bm.free(blocks)
    assert bm.num_used_blocks == 2
    bm.free(blocks[:2])
    assert bm.find_cached_blocks([*tokens, 99]) == blocks[:2]  # freed blocks stay cached ...
    bm.allocate(8)  # ... until they are reused
    assert bm.find_cached_blocks([*tokens, 99]) == []


def test_invalidated_blocks_are_not_found() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    blocks = bm.allocate(2)
    bm.cache_blocks([1, 2, 3, 4], blocks, 4)
    bm.invalidate(blocks)
    assert bm.find_cached_blocks([1, 2, 3, 4, 5]) == []


def test_prefix_caching_can_be_disabled() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    blocks = bm.allocate(2)
    bm.cache_blocks([1, 2, 3, 4], blocks, 4)
    assert bm.find_cached_blocks([1, 2, 3, 4, 5]) == []


def test_hash_memo_gives_the_same_hashes_incrementally() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(30))
    memo: list[int] = []
    for n in (3, 9, 17, 30):
        assert bm.block_hashes(tokens, n, memo) == bm.block_hashes(tokens, n)
    assert bm.block_hashes(tokens, 8, memo) == bm.block_hashes(tokens, 8)  # shorter than the memo


def test_num_used_blocks_follows_take_allocate_free() -> None:
    """num_used_blocks is a field kept by take/allocate/free (stats() reads it every step): it must
    equal the blocks out of the free list after any sequence of them, including a second holder of
    a held block and a cached block taken back from the free list."""
    rng = random.Random(7)
    bm = BlockManager(num_blocks=16, block_size=2)
    held: list[list[int]] = []
    cached: list[list[int]] = []  # token lists whose full blocks were cached
    for step in range(2000):
        op = rng.random()
        if op < 0.25 and bm.num_free_blocks:
            blocks = bm.allocate(rng.randint(1, min(3, bm.num_free_blocks)))
            tokens = [1000 + step, *range(2 * len(blocks) - 1)]
            bm.cache_blocks(tokens, blocks, len(tokens))
            held.append(blocks)
            cached.append(tokens)
        elif op < 0.35 and held:
            shared = rng.choice(held)[:1]  # a second holder (the reference count goes to 2)
            bm.take(shared)
            held.append(shared)
        elif op < 0.5 and cached:
            found = bm.find_cached_blocks([*rng.choice(cached), 0])  # may sit in the free list
            bm.take(found)
            held.append(found)
        elif held:
            bm.free(held.pop(rng.randrange(len(held))))
        assert bm.num_used_blocks == bm.num_blocks - bm.num_free_blocks
    for blocks in held:
        bm.free(blocks)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16


def test_request_token_fields_follow_append_token() -> None:
    """all_token_ids, num_tokens and num_prompt_tokens are fields (read by the scheduler and the model
    runner every step), kept by append_token."""
    req = Request("r", [1, 2, 3], SamplingParams(), IncrementalDetokenizer(ByteTokenizer()))
    assert (req.all_token_ids, req.num_tokens, req.num_prompt_tokens) == ([1, 2, 3], 3, 3)
    for token in (65, 66):
        req.append_token(token)
    assert req.output_token_ids == [65, 66]
    assert (req.all_token_ids, req.num_tokens, req.num_prompt_tokens) == ([1, 2, 3, 65, 66], 5, 3)


@pytest.mark.parametrize(("num_computed", "num_new", "samples"), [(0, 3, True), (0, 2, False), (2, 1, True)])
def test_scheduled_request_samples_when_it_reaches_the_last_token(
    num_computed: int, num_new: int, samples: bool
) -> None:
    req = Request("r", [1, 2, 3], SamplingParams(), IncrementalDetokenizer(ByteTokenizer()))
    req.num_computed_tokens = num_computed
    assert ScheduledRequest(req, num_new).samples is samples

