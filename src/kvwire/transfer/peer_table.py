"""A table of entries that peers create (decision 116): bounded per peer and in all.

What a peer can leave waiting on this side before this side knows the transfer (an early Grant, a
Pull of a transfer not started yet) is kept in a :class:`PeerTable`: at most ``per_peer`` entries per
peer endpoint and ``total`` in all, so one peer (or many spoofed endpoints) cannot grow memory without
bound or crowd the others out. :meth:`PeerTable.admit` names the limit a new entry would break.
Callers hold the agent lock (no locking here).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

from kvwire.transfer.stats import ControlLimit

K = TypeVar("K")
V = TypeVar("V")


class PeerTable(Generic[K, V]):
    """``key -> value``, each entry owned by the peer endpoint that created it."""

    def __init__(
        self, per_peer: int, total: int, per_peer_limit: ControlLimit, total_limit: ControlLimit
    ) -> None:
        self._per_peer = per_peer
        self._total = total
        self._limits = (per_peer_limit, total_limit)
        self._items: dict[K, tuple[str, V]] = {}
        self._counts: collections.Counter[str] = collections.Counter()

    def admit(self, key: K, peer: str) -> ControlLimit | None:
        """None when ``peer`` may put ``key`` now (a key it already holds always may), else the limit
        it would break."""
        held = self._items.get(key)
        if held is not None and held[0] == peer:
            return None
        if self._counts[peer] >= self._per_peer:
            return self._limits[0]
        if len(self._items) >= self._total:
            return self._limits[1]
        return None

    def put(self, key: K, peer: str, value: V) -> None:
        """Store (after :meth:`admit` said yes); replaces ``key``'s entry."""
        self.pop(key)
        self._items[key] = (peer, value)
        self._counts[peer] += 1

    def pop(self, key: K) -> V | None:
        held = self._items.pop(key, None)
        if held is None:
            return None
        peer = held[0]
        self._counts[peer] -= 1
        if self._counts[peer] <= 0:
            del self._counts[peer]
        return held[1]

    def get(self, key: K) -> V | None:
        held = self._items.get(key)
        return None if held is None else held[1]

    def peer_of(self, key: K) -> str | None:
        held = self._items.get(key)
        return None if held is None else held[0]

    def items(self) -> Iterator[tuple[K, V]]:
        """A snapshot: the table may change while the caller iterates."""
        return iter([(key, value) for key, (_, value) in self._items.items()])

    def count(self, peer: str) -> int:
        return self._counts[peer]

    def clear(self) -> None:
        self._items.clear()
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items
