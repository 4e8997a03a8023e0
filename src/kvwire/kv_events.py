"""KV events on the instance side: which prefix-cache block hashes an instance stores and evicts.

The engine (engine thread) calls :meth:`KvEventLog.stored` / :meth:`KvEventLog.removed` as blocks
enter and leave its prefix cache; the discovery client (its own thread) calls :meth:`drain` every
few tens of milliseconds and sends the batch to the router (:class:`~kvwire.discovery.messages.KvEvents`).

Changes are *coalesced*: the log keeps the set of hashes cached now and the set the router was last
told about, and a batch carries only the difference for the hashes touched since (a block stored
and evicted between two drains costs nothing on the wire). Memory is bounded by the cache size.
When a batch is lost (the queue to the router was full) the client calls :meth:`resync`: the next
batches say ``cleared`` and carry the whole cache again. Thread-safe; no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from kvwire.kv_hash import BlockHash

MAX_BATCH_HASHES = 4000  # stored + removed per batch: ~36 KB of msgpack, under the 64 KiB frame cap


@dataclass(frozen=True)
class KvEventBatch:
    block_size: int
    stored: list[BlockHash]
    removed: list[BlockHash]
    cleared: bool = False  # the router drops everything it knows about this instance first
    num_cached_blocks: int = 0  # hashes cached after this batch (for /instances)


class KvEventLog:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self._live: set[BlockHash] = set()
        self._announced: set[BlockHash] = set()
        self._dirty: dict[BlockHash, None] = {}  # touched since the last drain, in order
        self._cleared = False

    def stored(self, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                self._live.add(h)
                self._dirty[h] = None

    def removed(self, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                self._live.discard(h)
                self._dirty[h] = None

    def resync(self) -> None:
        """Forget what the router was told: the next batch is ``cleared`` and resends everything."""
        with self._lock:
            self._announced.clear()
            self._dirty = dict.fromkeys(self._live)
            self._cleared = True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._live)

    def drain(self, max_hashes: int = MAX_BATCH_HASHES) -> KvEventBatch | None:
        """The next batch of at most ``max_hashes`` changes; None when there is nothing to say."""
        with self._lock:
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
