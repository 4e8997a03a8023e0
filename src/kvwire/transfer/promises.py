"""Promised transfers: accepted by the send side, not started yet (their prefill may be queued).

:meth:`~kvwire.transfer.agent.TransferAgent.promise` keeps one here until ``start_send``, ``abort``
or its limit; meanwhile the receiver's lease on it is renewed (state QUEUED: decision 123). A
promise is this side's own word, whatever the receiver says. Every method runs with ``core.lock``.
"""

from __future__ import annotations

from kvwire.errors import TransferError
from kvwire.transfer.core import Core
from kvwire.transfer.lease import Lease, PeerState
from kvwire.transfer.messages import Renew

SIDE = "send"


class Promises:
    """transfer id -> (receiver endpoint, lease)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.table: dict[str, tuple[str, Lease]] = {}

    def promise(
        self, transfer_id: str, endpoint: str, deadline_s: float, limit_s: float | None, started: bool
    ) -> None:
        """The request behind ``transfer_id`` was accepted (its prefill may be queued): renew the
        receiver's lease (state QUEUED) until ``start``, ``forget`` or the limit. Nothing when the
        transfer ``started`` already, is promised or ended."""
        if started or transfer_id in self.table or self.core.tombstones.get(SIDE, transfer_id) is not None:
            return
        if len(self.table) >= self.core.config.max_pending_transfers:
            raise TransferError("too many promised transfers", transfer_id)
        lease = Lease.start(self.core.now(), deadline_s, limit_s)
        lease.next_renew = 0.0  # tell the receiver at once
        self.table[transfer_id] = (endpoint, lease)

    def started(self, transfer_id: str) -> None:
        """The send started: its own lease takes over."""
        self.table.pop(transfer_id, None)

    def forget(self, transfer_id: str, reason: str) -> None:
        """Drop a promise (the request ended before its send started): the receiver is told at once
        and later renewals of it are answered with an Abort."""
        entry = self.table.pop(transfer_id, None)
        if entry is not None:
            self.core.send_abort(entry[0], transfer_id, reason)
            self.core.tombstones.add(SIDE, transfer_id, reason)

    def drop_endpoint(self, endpoint: str) -> None:
        """The receiver at ``endpoint`` is gone: its promises go (nothing to tell it)."""
        for tid in [t for t, (e, _) in self.table.items() if e == endpoint]:
            del self.table[tid]

    def renew(self, now: float) -> None:
        """Renew (state QUEUED) each promise that is due; drop those past their limit (a request that
        never started)."""
        for tid in [t for t, (_, lease) in self.table.items() if lease.limit <= now]:
            del self.table[tid]
        for tid, (endpoint, lease) in self.table.items():
            if lease.due(now):
                msg = Renew(**self.core.header(endpoint, tid), state=PeerState.QUEUED.value, reply=False)
                self.core.send(endpoint, msg)

    def renewed_by(self, msg: Renew) -> bool:
        """True if ``msg`` is about a transfer promised to its sender."""
        entry = self.table.get(msg.transfer_id)
        return entry is not None and entry[0] == msg.src_endpoint
