"""One side's transfers in flight: the base both halves share for leases, expiry and failure.

Each transfer is a small state object (:class:`TransferState`: its id and its :class:`Lease`; the send
side's :class:`~kvwire.transfer.send_state.SendState`, the receive side's
:class:`~kvwire.transfer.recv_state.RecvState`). :class:`Transfers` is the table of one side: it ends a
transfer as failed (:meth:`Transfers.fail`, the one place that does), expires those past their lease,
sends the Renews that are due and checks that a Renew comes from the transfer's peer. A side adds
what only it frees (buffers, slabs, pieces) through the ``_released``/``_after_failure`` hooks.
Every method runs with ``core.lock`` held (decisions 051, 092, 123).
"""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

from kvwire.transfer.core import Core
from kvwire.transfer.enums import FailReason
from kvwire.transfer.lease import Lease
from kvwire.transfer.messages import Renew
from kvwire.transfer.types import PeerRef


@dataclasses.dataclass
class TransferState:
    """One transfer on one side: its id, its lease and, once bound, its peer."""

    transfer_id: str
    lease: Lease  # deadline, renewed while the peer shows life, up to its limit

    @property
    def bound_peer(self) -> PeerRef | None:
        """The peer (epoch + data address) the transfer is bound to; None until it is."""
        return None

    def peer_endpoint(self) -> str | None:
        """The control endpoint of the peer this side renews and tells of a failure (None: unknown)."""
        raise NotImplementedError

    def abort_endpoint(self) -> str | None:
        """Where a failure of this transfer is told (None: nowhere)."""
        return self.peer_endpoint()

    def expired(self, now: float) -> bool:
        return self.lease.deadline <= now


S = TypeVar("S", bound=TransferState)


class Transfers(Generic[S]):
    """The transfers of one side (``side``: "send" or "recv", the tombstones' key), by id."""

    side: str

    def __init__(self, core: Core) -> None:
        self.core = core
        self.table: dict[str, S] = {}

    # --- failure -----------------------------------------------------------------------------------------

    def fail(
        self,
        transfer_id: str,
        reason: str,
        notify: bool,
        label: str | None = None,
        wire_reason: str | None = None,
    ) -> bool:
        """End the transfer as failed with ``reason``; ``notify``: tell the peer (``wire_reason``, if
        given, is what it is told; the local reason otherwise). False: no such transfer here."""
        st = self.table.pop(transfer_id, None)
        if st is None:
            return False
        self.core.plane.cancel(transfer_id)
        self._released(st)
        self.core.record_failure(self.side, transfer_id, reason, label)
        endpoint = st.abort_endpoint()
        if notify and endpoint is not None:
            peer = st.bound_peer
            dst = peer.instance_id if peer is not None else None
            self.core.send_abort(endpoint, transfer_id, wire_reason or reason, dst)
        self._after_failure(st, reason)
        return True

    def _released(self, st: S) -> None:
        """Free what ``st`` holds (it left the table, the plane cancelled it; before it is reported)."""

    def _after_failure(self, st: S, reason: str) -> None:
        """What follows a failure on this side (the failure was reported and the peer told)."""

    def close(self, reason: str) -> None:
        """Fail every transfer in flight, telling each peer."""
        for tid in list(self.table):
            self.fail(tid, reason, notify=True)

    # --- leases ------------------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Fail (telling the peer) every transfer whose lease ended, unless the side keeps it."""
        for tid in [t for t, st in self.table.items() if st.expired(now)]:
            st = self.table.get(tid)  # (failing one may end another: a split's pieces)
            if st is None:
                continue
            what = self._expiring(st)
            if what is not None:
                self.fail(tid, f"{FailReason.DEADLINE.value}: {what}", notify=True)

    def _expiring(self, st: S) -> str | None:
        """``st``'s lease ended: what it lacks (the failure reason), or None when it ends otherwise."""
        raise NotImplementedError

    def renew(self, now: float) -> None:
        """Send a Renew to the peer of every transfer whose renewal is due (and whose peer is known)."""
        for st in self.table.values():
            endpoint = st.peer_endpoint()
            if endpoint is not None and st.lease.due(now):
                self.core.send(endpoint, self.renew_msg(endpoint, st.transfer_id, reply=False))

    def renew_msg(self, endpoint: str, transfer_id: str, reply: bool) -> Renew:
        """This side's Renew of ``transfer_id`` (its state here) to ``endpoint``."""
        raise NotImplementedError

    def renewed_by(self, msg: Renew) -> S | None:
        """The transfer ``msg`` renews, when it comes from that transfer's peer (its endpoint, and its
        epoch once bound); None otherwise (an older or newer epoch: the epoch checks handle it)."""
        st = self.table.get(msg.transfer_id)
        if st is None or st.peer_endpoint() != msg.src_endpoint:
            return None
        peer = st.bound_peer
        if peer is not None and peer.instance_id != msg.src_id:
            return None
        return st

    def bound_to(self, peer_id: str) -> list[str]:
        """The ids of the transfers bound to the peer epoch ``peer_id``."""
        return [t for t, st in self.table.items() if st.bound_peer and st.bound_peer.instance_id == peer_id]

    def __len__(self) -> int:
        return len(self.table)
