"""Quarantine: one-copy grants whose revoke was not confirmed, and the receiver memory they cover.

On the one-copy path a sender writes straight into the receiver's blocks under a grant
(:mod:`grants`). A revoke zeroes the grant's token and waits up to ``CANCEL_WAIT_S`` for the
slot's lock: a sender stalled in the middle of a layer for longer than that (stopped, swapped out,
a big layer on a busy box) still holds the lock and will finish copying that layer whenever it runs
again. Until it lets go, the transfer's destination blocks must not be reused, or that late copy
lands in another request's KV (docs/decisions/114-shm-revoke-quarantine.md).

Such a grant is *quarantined* here: its slot stays out of use and its transfer is reported
unsettled (:meth:`ShmPlane.unsettled`), so the connector keeps the blocks from the engine's pool.
Quarantine ends only on proof that nothing writes under the grant any more: its slot lock can be
taken, which happens once the sender let go of it (finished or stopped the layer) or its process
ended (the kernel drops the lock of a dead holder). A finished transfer's slot whose sender had not
let go yet when the last layer landed is parked here too (``transfer_id`` empty): its data is all
in place, so nothing waits for it; only the slot comes back later. Slots are those of the
sender's own grant region (:mod:`regions`), which a quarantined slot keeps alive until it settles.
Not thread-safe: the plane's lock guards it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kvwire.transfer.planes.shm.regions import GrantRegions

log = logging.getLogger("kvwire.transfer")


@dataclasses.dataclass
class Quarantined:
    """A grant slot a sender may still write under."""

    transfer_id: str  # "" for a finished transfer's slot (not unsettled: its layers all landed)
    peer_id: str
    slot: int  # in ``peer_id``'s grant region
    num_bytes: int  # destination bytes the grant covers (what stays out of use)
    sender_pid: int | None  # the sender's process (SO_PEERCRED of its link), for the log
    since: float = dataclasses.field(default_factory=time.monotonic)
    # the destination tensors: kept alive, so a receive buffer of the shared arena (which returns
    # to the arena with its last tensor) is not handed out again while the sender may write into it
    keep: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)


class Quarantine:
    """The receiver's quarantined grants, by (peer, slot)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], Quarantined] = {}

    def add(self, entry: Quarantined) -> None:
        self._held[(entry.peer_id, entry.slot)] = entry
        if entry.transfer_id:
            log.warning(
                "shared-memory grant of transfer %s: sender %s (pid %s) still holds slot %d after "
                "the revoke wait; its %d destination bytes stay quarantined until it lets go or exits",
                entry.transfer_id, entry.peer_id[:8], entry.sender_pid, entry.slot, entry.num_bytes,
            )  # fmt: skip

    def settle(self, regions: GrantRegions, peer_id: str | None = None) -> list[Quarantined]:
        """Try every quarantined slot (of ``peer_id``, or all) without waiting, each in its
        sender's region; return and forget those nobody holds any more (their slots are free)."""
        released = [
            q for q in self._held.values()
            if (peer_id is None or q.peer_id == peer_id) and _release(regions, q)
        ]  # fmt: skip
        for q in released:
            del self._held[(q.peer_id, q.slot)]
            if q.transfer_id:
                log.info(
                    "shared-memory grant of transfer %s released by sender %s after %.3f s: its %d "
                    "destination bytes may be reused",
                    q.transfer_id, q.peer_id[:8], time.monotonic() - q.since, q.num_bytes,
                )  # fmt: skip
        return released

    def unsettled(self) -> dict[str, int]:
        """Transfer id -> destination bytes, of every quarantined transfer."""
        return {q.transfer_id: q.num_bytes for q in self._held.values() if q.transfer_id}

    def holds_peer(self, peer_id: str) -> bool:
        """Whether a transfer of ``peer_id`` is quarantined (that sender is stalled)."""
        return any(q.peer_id == peer_id and q.transfer_id for q in self._held.values())

    def holds_region(self, peer_id: str) -> bool:
        """Whether any slot of ``peer_id``'s region is quarantined (finished transfers' too)."""
        return any(q.peer_id == peer_id for q in self._held.values())

    def clear(self) -> None:
        self._held.clear()


def _release(regions: GrantRegions, entry: Quarantined) -> bool:
    table = regions.table(entry.peer_id)
    return table is None or table.try_release(entry.slot)  # no region: nothing left to write under
