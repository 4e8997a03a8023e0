"""Grant regions: one grant table per sending peer, so no peer can touch another's grants.

A grant table (:mod:`grants`) is shared memory the sender maps writable: it must be, since the
sender takes its slot locks on it and a revoke is only confirmed through those locks. With one
table for every link, any peer that passed the hello could zero another peer's tokens (its
transfers stop: a denial of service) or hold another peer's slot locks (its revokes never confirm:
its blocks stay quarantined). Here each peer instance gets a table of its own, its *region*: its
grants are claimed only there, its link's setup hands over only that one, and a revoke or a
quarantine release looks only there (docs/decisions/127-shm-grant-regions.md).

Regions are bounded: a link's setup makes its peer's region if there is none (live links are
capped by the listener's ``max_connections``); a grant made before the peer linked (its first
transfer) makes one only while fewer than ``max_connections`` exist, otherwise that transfer takes
the ring (``kvwire_limit_hits_total{limit="shm_grant_regions_full"}``). So at most twice the
listener cap exist at once. A region is freed once its peer has no live link, no grant outstanding
and nothing quarantined in it (a quarantined slot keeps its region until it settles, decision 114).
Not thread-safe: the plane's lock guards it.
"""

from __future__ import annotations

import collections

from kvwire.supervision import HealthBoard
from kvwire.transfer.planes.shm.grants import DEFAULT_SLOTS, GrantTable

REGIONS_FULL = "shm_grant_regions_full"  # kvwire_limit_hits_total{limit}: a grant sent to the ring


class GrantRegions:
    """The receiver's grant tables, by peer instance id."""

    def __init__(self, max_regions: int, board: HealthBoard, slots: int = DEFAULT_SLOTS) -> None:
        self.max_regions = max_regions
        self._board = board
        self._slots = slots
        self._tables: dict[str, GrantTable] = {}
        self._links: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._tables)

    def table(self, peer_id: str) -> GrantTable | None:
        """``peer_id``'s region, if it has one."""
        return self._tables.get(peer_id)

    def for_link(self, peer_id: str) -> GrantTable:
        """A link of ``peer_id`` is being set up: its region (made if needed), counted as in use
        until :meth:`link_closed`."""
        self._links[peer_id] += 1
        return self._make(peer_id)

    def link_closed(self, peer_id: str) -> None:
        """A link counted by :meth:`for_link` ended: its region is freed if nothing else holds it."""
        self._links[peer_id] -= 1
        if self._links[peer_id] <= 0:
            del self._links[peer_id]
            self.free_if_idle(peer_id)

    def for_grant(self, peer_id: str) -> GrantTable | None:
        """The region to claim a grant of ``peer_id`` in; None when it has none and the cap is
        reached (that transfer takes the ring)."""
        table = self._tables.get(peer_id)
        if table is not None:
            return table
        if len(self._tables) >= self.max_regions:
            self._board.limit_hit(REGIONS_FULL)
            return None
        return self._make(peer_id)

    def free_if_idle(self, peer_id: str) -> None:
        """Free ``peer_id``'s region when no link of it is live and none of its slots is in use (a
        grant outstanding, or a quarantined one: its slot is not free until it settles)."""
        table = self._tables.get(peer_id)
        if table is None or self._links.get(peer_id, 0) > 0 or table.in_use():
            return
        del self._tables[peer_id]
        table.close()

    def close(self) -> None:
        for table in self._tables.values():
            table.close()
        self._tables.clear()
        self._links.clear()

    def _make(self, peer_id: str) -> GrantTable:
        table = self._tables.get(peer_id)
        if table is None:
            table = self._tables[peer_id] = GrantTable(self._slots)
        return table
