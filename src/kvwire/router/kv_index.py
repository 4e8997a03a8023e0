"""The router's KV index: which instance holds which prefix-cache block, from the instances' KV events.

Fed by the discovery listener thread (:meth:`KvIndex.apply`), read by the event loop
(:meth:`KvIndex.match`); one lock. Bounded: at most ``max_blocks`` distinct hashes are kept, the
least recently stored ones dropped first (the instance probably evicted them too; a stale entry
costs a missed hit, never a wrong answer: instances check their own cache).

An instance's entries are dropped when it leaves (:meth:`drop`, called by the registry when it
forgets or deregisters it) and replaced when it restarts (a batch of a newer epoch). Batches of an
older epoch are ignored. Hashes are :mod:`kvwire.protocol.kv_blocks` chains; no torch.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvwire.discovery.heartbeats import KvEvents
from kvwire.protocol.kv_blocks import BlockHash

DEFAULT_MAX_BLOCKS = 1 << 20  # hashes: ~200 MB worst case; a 2-core box's tiny clusters use far less


@dataclass
class _Holder:
    epoch: int
    block_size: int
    hashes: set[BlockHash]
    reported_blocks: int = 0  # what the instance said it holds (its own count)


class KvIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be > 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._where: OrderedDict[BlockHash, set[str]] = OrderedDict()  # least recently stored first
        self._holders: dict[str, _Holder] = {}
        self._block_sizes: Counter[int] = Counter()  # block size -> instances using it
        self.num_dropped_blocks = 0  # hashes forgotten to stay within max_blocks

    # --- writers (discovery listener thread) ------------------------------------------------------

    def apply(self, msg: KvEvents) -> bool:
        """Apply one batch; False when it is stale (an older epoch of the instance)."""
        with self._lock:
            holder = self._holders.get(msg.instance_id)
            if holder is not None and msg.epoch < holder.epoch:
                return False
            if holder is None or msg.epoch > holder.epoch or msg.block_size != holder.block_size:
                self._drop_locked(msg.instance_id)
                holder = self._holders[msg.instance_id] = _Holder(msg.epoch, msg.block_size, set())
                self._block_sizes[msg.block_size] += 1
            elif msg.cleared:
                self._forget_all(msg.instance_id, holder)
            for h in msg.removed:
                self._forget(msg.instance_id, holder, h)
            for h in msg.stored:
                holders = self._where.get(h)
                if holders is None:
                    holders = self._where[h] = set()
                else:
                    self._where.move_to_end(h)
                holders.add(msg.instance_id)
                holder.hashes.add(h)
            holder.reported_blocks = msg.num_cached_blocks
            self._trim()
            return True

    def drop(self, instance_id: str) -> None:
        """Forget every entry of ``instance_id`` (it left)."""
        with self._lock:
            self._drop_locked(instance_id)

    def _drop_locked(self, instance_id: str) -> None:
        holder = self._holders.pop(instance_id, None)
        if holder is not None:
            self._forget_all(instance_id, holder)
            self._block_sizes[holder.block_size] -= 1
            if self._block_sizes[holder.block_size] <= 0:
                del self._block_sizes[holder.block_size]

    def _forget_all(self, instance_id: str, holder: _Holder) -> None:
        for h in list(holder.hashes):
            self._forget(instance_id, holder, h)

    def _forget(self, instance_id: str, holder: _Holder, h: BlockHash) -> None:
        holder.hashes.discard(h)
        holders = self._where.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._where[h]

    def _trim(self) -> None:
        while len(self._where) > self.max_blocks:
            h, holders = self._where.popitem(last=False)
            for instance_id in holders:
                holder = self._holders.get(instance_id)
                if holder is not None:
                    holder.hashes.discard(h)
            self.num_dropped_blocks += 1

    # --- readers (event loop) -----------------------------------------------------------------------

    def block_size(self, instance_id: str) -> int | None:
        holder = self._holders.get(instance_id)
        return None if holder is None else holder.block_size

    def num_blocks(self, instance_id: str) -> int:
        """Blocks of ``instance_id`` in the index."""
        holder = self._holders.get(instance_id)
        return 0 if holder is None else len(holder.hashes)

    def match(
        self, instance_ids: Iterable[str], hashes_for: Callable[[int], list[BlockHash]]
    ) -> dict[str, int]:
        """For each instance, how many leading blocks of the request it holds.

        ``hashes_for(block_size)`` returns the request's chained block hashes for that block size
        (instances may differ). Instances the index knows nothing about match 0 blocks.
        """
        out: dict[str, int] = {}
        cache: dict[int, list[BlockHash]] = {}
        with self._lock:
            for instance_id in instance_ids:
                holder = self._holders.get(instance_id)
                if holder is None or not holder.hashes:
                    out[instance_id] = 0
                    continue
                hashes = cache.get(holder.block_size)
                if hashes is None:
                    hashes = cache[holder.block_size] = hashes_for(holder.block_size)
                n = 0
                for h in hashes:
                    if h not in holder.hashes:
                        break
                    n += 1
                out[instance_id] = n
        return out

    def holders(self, hashes_for: Callable[[int], list[BlockHash]]) -> set[str]:
        """The instances holding the request's first block (for their block size): every instance
        :meth:`match` would give at least one block. O(block sizes in use + those instances)."""
        out: set[str] = set()
        with self._lock:
            for block_size in self._block_sizes:
                hashes = hashes_for(block_size)
                if not hashes:
                    continue
                for instance_id in self._where.get(hashes[0], ()):
                    holder = self._holders.get(instance_id)
                    if holder is not None and holder.block_size == block_size:
                        out.add(instance_id)
        return out

    def __len__(self) -> int:
        return len(self._where)
