"""Deadlines of etcd records, for expiring silent instances (decision 098).

An instance's record promises the next within ``ttl_s`` (decision 095). The router keeps, per
instance, the deadline its last record set, in a heap keyed on deadlines: the next one due is found
in O(log N) and nothing scans every instance. What the router does when one passes (ask etcd
whether the instance's key is still at the revision the router last saw) is in
:mod:`kvwire.router.etcd_probe`. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import heapq


class DeadlineHeap:
    """Each instance's current deadline (registry clock); superseded entries are dropped lazily."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._due: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, ident: object) -> bool:
        return ident in self._due

    def set(self, ident: str, deadline: float) -> None:
        """``ident``'s deadline is now ``deadline`` (replacing any earlier one)."""
        self._due[ident] = deadline
        heapq.heappush(self._heap, (deadline, ident))

    def discard(self, ident: str) -> None:
        self._due.pop(ident, None)

    def clear(self) -> None:
        self._heap.clear()
        self._due.clear()

    def earliest(self) -> float | None:
        """The earliest current deadline (None: none). Drops superseded entries on the way, so the
        heap holds about one entry per instance per record within a TTL."""
        heap, due = self._heap, self._due
        while heap and due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_before(self, as_of: float, limit: int | None = None) -> list[str]:
        """Remove and return the instances whose deadline is before ``as_of`` (at most ``limit``,
        earliest first)."""
        out: list[str] = []
        while limit is None or len(out) < limit:
            first = self.earliest()
            if first is None or first >= as_of:
                break
            _, ident = heapq.heappop(self._heap)
            del self._due[ident]
            out.append(ident)
        return out
