"""Prefix-cache blocks by content: the chained block hash (shared by instances and the router) and the
instance's log of the hashes it stores and evicts (KV events).

**Block hashes.** A block holds ``block_size`` token ids. Block ``i``'s hash covers its own tokens *and*
every token before it (a chain): ``h_i = H(h_{i-1}, tokens[i*bs:(i+1)*bs])`` with ``h_{-1} = 0``, where
``H`` is BLAKE2b (8-byte digest, read as an unsigned 64-bit integer) over the parent hash and the token
ids, each as 8 little-endian bytes. Only full blocks have a hash. Two sequences share block ``i``'s hash
exactly when they share their first ``(i+1)*bs`` tokens (up to 64-bit collisions). Unlike Python's
``hash()``, the value does not depend on the interpreter or the process, so an instance can announce
hashes (KV events, :mod:`kvwire.discovery.heartbeats`) and the router can compute the same hashes for an
incoming prompt and look them up.

**KV events** (instance side). The engine (engine thread) calls :meth:`KvEventLog.stored` /
:meth:`KvEventLog.removed` as blocks enter and leave its prefix cache; the discovery client (its own
thread) calls :meth:`KvEventLog.drain` every few tens of milliseconds and sends the batch to the router
(:class:`~kvwire.discovery.heartbeats.KvEvents`). Changes are *coalesced*: the log keeps the set of
hashes cached now and the set the router was last told about, and a batch carries only the difference
for the hashes touched since (a block stored and evicted between two drains costs nothing on the
wire). Memory is bounded by the cache size. When a batch is lost (the queue to the router was full)
the client calls :meth:`KvEventLog.resync`: the next batches say ``cleared`` and carry the whole cache
again. Memory stays bounded when nobody drains (an instance without a router): past ``max_pending``
touched hashes the log forgets them and marks itself for a resync instead. Thread-safe.

Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = int  # unsigned 64-bit
ROOT_HASH: BlockHash = 0  # the parent of block 0

_PARENT = struct.Struct("<Q")


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The chained hash of one full block of ``tokens`` following a block whose hash is ``parent``."""
    h = hashlib.blake2b(_PARENT.pack(parent), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, num_tokens: int | None = None,
    memo: list[BlockHash] | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids[:num_tokens]`` (all tokens when None).

    ``memo`` (a list owned by the caller, extended in place) keeps earlier blocks' hashes so that a
    growing sequence hashes each block once; the result is a prefix of it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    hashes = [] if memo is None else memo
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, n - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes[: max(n, 0) // block_size]


# --- KV events (instance side) ---------------------------------------------------------------

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
