"""KV block allocation with reference counts and prefix caching.

Each block holds ``block_size`` tokens of every layer's KV. A block is *free* when no request holds it
(ref count 0). A full block whose KV was computed is registered under a hash of its tokens and of
every token before it (a hash chain); a later request with the same prefix takes the block instead
of recomputing it. Free blocks stay cached until they are reused (least recently freed first).
The hashes are those of :mod:`kvwire.protocol.kv_blocks` (shared with the router); every hash that enters or
leaves the cache is reported to the optional :class:`~kvwire.protocol.kv_blocks.KvEventLog` (KV events).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvwire.protocol.kv_blocks import BlockHash, KvEventLog, block_hashes


class BlockManager:
    """Owned by the scheduler (engine thread only)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        events: KvEventLog | None = None,
    ) -> None:
        self.events = events
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self._hash_of_block: dict[int, BlockHash] = {}
        self._block_of_hash: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` no request holds (they are in the free list)."""
        return sum(1 for block in block_ids if self._ref_counts[block] == 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ---------------------------------------------------------------------------

    def block_hashes(
        self, token_ids: Sequence[int], num_tokens: int, memo: list[BlockHash] | None = None
    ) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids[:num_tokens]``. ``memo`` (a request's
        list, extended in place) keeps earlier blocks' hashes so each block is hashed once."""
        return block_hashes(token_ids, self.block_size, max(num_tokens, 0), memo)

    def find_cached_blocks(self, token_ids: Sequence[int], memo: list[BlockHash] | None = None) -> list[int]:
        """Longest run of cached blocks that prefixes ``token_ids``, leaving at least one token to
        compute (the step that computes it samples the next token). Takes no references."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for block_hash in self.block_hashes(token_ids, len(token_ids) - 1, memo):
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def cache_blocks(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed_tokens: int,
        memo: list[BlockHash] | None = None,
    ) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(token_ids, num_computed_tokens, memo)
        new: list[BlockHash] = []
        for block, block_hash in zip(block_ids, hashes, strict=False):
            if block not in self._hash_of_block and block_hash not in self._block_of_hash:
                self._block_of_hash[block_hash] = block
                self._hash_of_block[block] = block_hash
                new.append(block_hash)
        if new and self.events is not None:
            self.events.stored(new)

    # --- allocation -------------------------------------------------------------------------------

    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to blocks found by :meth:`find_cached_blocks`."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks (evicting cached ones, least recently freed first)."""
        if num_blocks > len(self._free):
            raise MemoryError(f"{num_blocks} KV blocks asked, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Tail blocks are freed first so that they are evicted
        before the prefix blocks other requests are more likely to share."""
        for block in reversed(block_ids):
            assert self._ref_counts[block] > 0, f"block {block} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def invalidate(self, block_ids: Sequence[int]) -> None:
        """Forget the cached content of blocks (their KV is wrong, e.g. a failed remote load)."""
        for block in block_ids:
            self._evict(block)

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None and self._block_of_hash.get(block_hash) == block:
            del self._block_of_hash[block_hash]
            if self.events is not None:
                self.events.removed((block_hash,))
