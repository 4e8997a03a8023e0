from __future__ import annotations

import pytest

from kvwire.engine.scheduler import BlockManager


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
