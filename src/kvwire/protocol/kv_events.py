"""KV events on the instance side: which prefix-cache block hashes an instance stores and evicts.

The engine (engine thread) calls :meth:`KvEventLog.stored` / :meth:`KvEventLog.removed` as blocks
enter and leave its prefix cache; the discovery client (its own thread) calls :meth:`drain` every
few tens of milliseconds and sends the batch to the router (:class:`~kvwire.discovery.heartbeats.KvEvents`).

Changes are *coalesced*: the log keeps the set of hashes cached now and the set the router was last
told about, and a batch carries only the difference for the hashes touched since (a block stored
and evicted between two drains costs nothing on the wire). Memory is bounded by the cache size.
When a batch is lost (the queue to the router was full) the client calls :meth:`resync`: the next
batches say ``cleared`` and carry the whole cache again. Memory stays bounded when nobody drains
(an instance without a router): past ``max_pending`` touched hashes the log forgets them and marks
itself for a resync instead. Thread-safe; no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from kvwire.protocol.kv_hash import BlockHash

MAX_BATCH_HASHES = 4000  # stored + removed per batch: ~36 KB of msgpack, under the 64 KiB frame cap


@dataclass(frozen=True)
class KvEventBatch:
    block_size: int
    stored: list[BlockHash]
    removed: list[BlockHash]
    cleared: bool = False  # the router drops everything it knows about this instance first
    num_cached_blocks: int = 0  # hashes cached after this batch (for /instances)


class KvEventLog:
    def __init__(self, block_size: int, max_pending: int = 1 << 16) -> None:
        self.block_size = block_size
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._live: set[BlockHash] = set()
        self._announced: set[BlockHash] = set()
        self._dirty: dict[BlockHash, None] = {}  # touched since the last drain, in order
        self._cleared = False
        self._overflow = False  # too many changes piled up undrained: resync at the next drain

    def stored(self, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                self._live.add(h)
                if not self._overflow:
                    self._dirty[h] = None
            self._bound()

    def removed(self, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                self._live.discard(h)
                if not self._overflow:
                    self._dirty[h] = None
            self._bound()

    def _bound(self) -> None:
        if len(self._dirty) > self.max_pending:
            self._dirty.clear()  # rebuilt from the live set by the resync at the next drain
            self._overflow = True

    def resync(self) -> None:
        """Forget what the router was told: the next batch is ``cleared`` and resends everything."""
        with self._lock:
            self._resync_locked()

    def _resync_locked(self) -> None:
        self._announced.clear()
        self._dirty = dict.fromkeys(self._live)
        self._cleared = True
        self._overflow = False

    @property
    def num_cached_blocks(self) -> int:
        return len(self._live)

    def drain(self, max_hashes: int = MAX_BATCH_HASHES) -> KvEventBatch | None:
        """The next batch of at most ``max_hashes`` changes; None when there is nothing to say."""
        with self._lock:
            if self._overflow:
                self._resync_locked()
            if not self._dirty and not self._cleared:
                return None
            stored: list[BlockHash] = []
            removed: list[BlockHash] = []
            taken = 0
            for h in self._dirty:
                if taken >= max_hashes:
                    break
                taken += 1
                if h in self._live and h not in self._announced:
                    self._announced.add(h)
                    stored.append(h)
                elif h not in self._live and h in self._announced:
                    self._announced.discard(h)
                    removed.append(h)
            for h in list(self._dirty)[:taken]:
                del self._dirty[h]
            cleared, self._cleared = self._cleared, False
            if not (stored or removed or cleared):
                return None
            return KvEventBatch(self.block_size, stored, removed, cleared, len(self._announced))
