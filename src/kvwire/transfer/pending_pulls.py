"""Pulls that came before ``start_send``: held until the puller's (clamped) deadline.

Bounded per puller and in all (decision 116): a peer cannot grow this table without bound or crowd
the others out; a refused or expired pull is answered with an Abort. Every method runs with
``core.lock`` held.
"""

from __future__ import annotations

from kvwire.transfer.core import Core
from kvwire.transfer.enums import FailReason
from kvwire.transfer.wire import ControlLimit, PeerTable, Pull

SIDE = "send"


class PendingPulls:
    """transfer id -> (pull, until)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        limits = core.config.limits
        self.table: PeerTable[str, tuple[Pull, float]] = PeerTable(
            limits.max_pending_per_peer, limits.max_pending_pulls, ControlLimit.PENDING_PER_PEER,
            ControlLimit.PENDING_PULLS,
        )  # fmt: skip

    def hold(self, msg: Pull) -> None:
        """A pull overtook start_send: hold it until the puller's (clamped) deadline, unless the
        transfer already ended here or the puller (or everyone) has too many held (refused)."""
        ended = self.core.tombstones.get(SIDE, msg.transfer_id)
        limit = None if ended is not None else self.table.admit(msg.transfer_id, msg.src_endpoint)
        if ended is not None or limit is not None:
            if limit is not None:
                self.core.stats.limit_hit(limit)
            reason = ended or f"too many pending pulls ({limit.value if limit else ''})"
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)
            return
        until = self.core.now() + self.core.peer_deadline(msg.deadline_s)
        self.table.put(msg.transfer_id, msg.src_endpoint, (msg, until))

    def take(self, transfer_id: str) -> Pull | None:
        """The pull held for ``transfer_id`` (which starts now), once."""
        entry = self.table.pop(transfer_id)
        return entry[0] if entry is not None else None

    def expire(self, now: float) -> None:
        """Answer each pull held past its deadline: the transfer is unknown here."""
        for tid, (msg, until) in self.table.items():
            if until <= now:
                self.table.pop(tid)
                self.core.send_abort(msg.src_endpoint, tid, FailReason.UNKNOWN.value, msg.src_id)

    def items(self) -> list[tuple[str, tuple[Pull, float]]]:
        return list(self.table.items())

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self.table

    def __len__(self) -> int:
        return len(self.table)
