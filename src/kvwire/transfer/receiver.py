"""Receive side of the agent: expectations, offers, renewals and failures of the transfers it receives.

Credit (grants from the memory budget, early grants) is :mod:`kvwire.transfer.grants`; what happens
once a layer lands (sinks, acks, completion) is :mod:`kvwire.transfer.arrivals`; leases, expiry and
the one ``fail`` are :mod:`kvwire.transfer.core` (``Transfers``).
"""

from __future__ import annotations

import collections

import msgspec
import torch

from kvwire.errors import TransferError
from kvwire.transfer.arrivals import Arrivals
from kvwire.transfer.control_messages import Offer, Pull, Renew, Trailer
from kvwire.transfer.core import Core, Transfers
from kvwire.transfer.enums import FailReason
from kvwire.transfer.grants import Credit
from kvwire.transfer.lease import Lease, PeerState
from kvwire.transfer.recv_state import RecvState, SpansFn, WriteGuard
from kvwire.transfer.registered_caches import BlockTarget, PagedKV
from kvwire.transfer.stats import ControlLimit
from kvwire.transfer.types import DTYPES_BY_NAME, LayerSink, LayerSpec, PeerRef, PullSlice

SIDE = "recv"
_SENDER_PROGRESS = frozenset({PeerState.QUEUED.value, PeerState.SENDING.value})

__all__ = ["Receiver", "RecvState", "SpansFn", "WriteGuard"]


class UnsolicitedOffers:
    """Offers that came before ``expect()``: held (as transfers of the receiver's table) until the
    caller expects them or their lease ends; at most ``max_pending_per_peer`` per sender endpoint and
    ``max_pending_transfers`` transfers in all (decision 116)."""

    def __init__(self, core: Core, recvs: dict[str, RecvState]) -> None:
        self.core = core
        self.recvs = recvs
        # per sender endpoint: its Offers held here that expect() has not claimed yet
        self.counts: collections.Counter[str] = collections.Counter()

    def admit(self, msg: Offer, deadline_s: float) -> RecvState | None:
        """State for an Offer that came before expect(), unless this agent or that sender has too
        many (refused with an Abort)."""
        limit = None
        if len(self.recvs) >= self.core.config.max_pending_transfers:
            limit = ControlLimit.PENDING_TRANSFERS
        elif self.counts[msg.src_endpoint] >= self.core.config.limits.max_pending_per_peer:
            limit = ControlLimit.PENDING_PER_PEER
        if limit is not None:
            self.core.stats.limit_hit(limit)
            reason = f"receiver has too many transfers ({limit.value})"
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)
            return None
        lease = Lease.start(self.core.now(), deadline_s, self.core.config.default_limit_s)
        st = self.recvs[msg.transfer_id] = RecvState(msg.transfer_id, lease, unsolicited_by=msg.src_endpoint)
        self.counts[msg.src_endpoint] += 1
        return st

    def claim(self, st: RecvState) -> None:
        """``st`` no longer counts as its sender's unsolicited Offer (expected now, or ended)."""
        peer, st.unsolicited_by = st.unsolicited_by, None
        if peer is not None:
            self.counts[peer] -= 1
            if self.counts[peer] <= 0:
                del self.counts[peer]


class Receiver(Transfers[RecvState]):
    """Every method runs with ``core.lock`` held, except the sink calls the agent makes."""

    side = SIDE

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.credit = Credit(self)
        self.arrivals = Arrivals(self)
        self.unsolicited = UnsolicitedOffers(core, self.table)

    @property
    def recvs(self) -> dict[str, RecvState]:
        return self.table

    # --- API ---------------------------------------------------------------------------------------------

    def expect(
        self,
        transfer_id: str,
        num_layers: int,
        sink: LayerSink | None,
        deadline_s: float,
        pull_from: str | None,
        scatter_into: SpansFn | None = None,
        into_blocks: tuple[PagedKV, BlockTarget] | None = None,
        accept_from: str | None = None,
        sender: str | None = None,
        limit_s: float | None = None,
        pull_slice: PullSlice | None = None,
    ) -> bool:
        """Returns True when buffered layers must now be delivered to the new sink. Raises
        TransferError when the transfer was already offered by another agent than ``accept_from``
        (that transfer is failed: its data is never delivered)."""
        accept_from = accept_from or pull_from
        st = self._expected_state(transfer_id, num_layers, deadline_s, accept_from, limit_s)
        self.unsolicited.claim(st)
        st.expected, st.num_layers, st.sink, st.pull_from = True, num_layers, sink, pull_from
        st.accept_from = accept_from
        st.sender = sender if st.sender is None else st.sender
        if scatter_into is not None:
            st.scatter_into = scatter_into
            st.sink = lambda index, data: scatter_into(index).scatter(data)  # layers buffered already
        if into_blocks is not None:
            paged, target = st.paged, st.target = into_blocks
            st.guard = WriteGuard()
            st.sink = st.guard.wrap(lambda index, data: paged.write(index, target, data))  # copy path
        self.core.stats.add("recvs_started")
        if pull_from is not None and st.peer is None:
            self.core.send(pull_from, self._pull_msg(pull_from, transfer_id, deadline_s, pull_slice))
        if st.specs is not None and not self._check_offer(st):
            return False
        self.credit.grant_early(st)
        self.arrivals.maybe_complete(st)
        return bool(st.held) and st.sink is not None and transfer_id in self.table

    def _expected_state(
        self, transfer_id: str, num_layers: int, deadline_s: float, accept_from: str | None,
        limit_s: float | None,
    ) -> RecvState:  # fmt: skip
        """The state ``expect`` fills in: the one an Offer made already, or a new one."""
        if not transfer_id or num_layers <= 0:
            raise TransferError("expect needs a transfer_id and num_layers > 0", transfer_id)
        st = self.table.get(transfer_id)
        if st is not None and st.expected:
            raise TransferError(f"transfer {transfer_id} is already expected", transfer_id)
        if st is not None and st.peer is not None and accept_from and st.peer.endpoint != accept_from:
            self._refused(st.peer.endpoint, transfer_id)
            self.fail(transfer_id, f"{FailReason.REFUSED.value}: offered by an unexpected peer", notify=True)
            raise TransferError(f"transfer {transfer_id} was offered by {st.peer.endpoint}, not by "
                                f"its peer {accept_from}", transfer_id)  # fmt: skip
        now = self.core.now()
        if limit_s is None:
            limit_s = self.core.config.default_limit_s
        if st is None:
            if len(self.table) >= self.core.config.max_pending_transfers:
                raise TransferError("too many transfers in flight", transfer_id)
            st = self.table[transfer_id] = RecvState(transfer_id, Lease.start(now, deadline_s, limit_s), now)
        st.lease.tighten(now, deadline_s, limit_s)
        return st

    def _pull_msg(self, endpoint: str, transfer_id: str, deadline_s: float, piece: PullSlice | None) -> Pull:
        info = self.core.plane.local_info(PeerRef(endpoint, self.core.peer_ids.get(endpoint), ""))
        msg = Pull(**self.core.header(endpoint, transfer_id), deadline_s=deadline_s,
                   data_address=self.core.plane.address, plane_info=info)  # fmt: skip
        if piece is None:
            return msg
        heads = [] if piece.heads is None else [piece.heads.start, piece.heads.stop]
        return msgspec.structs.replace(msg, held=piece.held_id, heads=heads, pieces=piece.pieces)

    def release(self, held_id: str, endpoint: str, deadline_s: float) -> None:
        """A piece pull of nothing: the sender ends the held transfer (split_pull)."""
        self.core.send(endpoint, self._pull_msg(endpoint, held_id, deadline_s, PullSlice(held_id, None, 0)))

    def take_layers(self, transfer_id: str) -> dict[int, torch.Tensor]:
        return self.arrivals.take_layers(transfer_id)

    def take_trailer(self, transfer_id: str) -> bytes | None:
        return self.arrivals.take_trailer(transfer_id)

    # --- messages ----------------------------------------------------------------------------------------

    def on_offer(self, msg: Offer) -> None:
        tid = msg.transfer_id
        st = self.table.get(tid)
        if st is not None and st.accept_from is not None and msg.src_endpoint != st.accept_from:
            self._refused(msg.src_endpoint, tid)  # not the pair's sender: leave the transfer alone
            self.core.send_abort(msg.src_endpoint, tid, "not this transfer's peer", msg.src_id)
            return
        ended = self.core.tombstones.get(SIDE, tid)
        if (st is None and ended is not None) or (st is not None and st.specs is not None):
            if st is None:
                self.core.send_abort(msg.src_endpoint, tid, ended or "ended", msg.src_id)
            return  # a duplicate offer is ignored
        if len(msg.layers) > self.core.config.max_layers_per_transfer or not msg.layers:
            self.core.send_abort(
                msg.src_endpoint, tid, f"{FailReason.MISMATCH.value}: bad layer count", msg.src_id
            )
            return
        deadline_s = self.core.peer_deadline(msg.deadline_s)
        st = st if st is not None else self.unsolicited.admit(msg, deadline_s)
        if st is None or not self._offer_from_granted(st, msg):
            return
        st.lease.tighten(self.core.now(), deadline_s, None)
        st.specs = [LayerSpec(tuple(w.shape), DTYPES_BY_NAME[w.dtype]) for w in msg.layers]
        st.with_trailer = msg.with_trailer
        st.peer = PeerRef(msg.src_endpoint, msg.src_id, msg.data_address, msg.plane_info)
        if msg.plane_info:
            self.core.plane.on_peer_info(st.peer, msg.plane_info)
        if st.expected and not self._check_offer(st):
            return
        self.credit.offered(st)
        if st.early and tid in self.table:
            self.arrivals.maybe_complete(st)  # early-granted layers may all have landed before the Offer

    def _offer_from_granted(self, st: RecvState, msg: Offer) -> bool:
        """False (the transfer failed) when ``st`` was granted early to another sender than the
        Offer's (a restart was handled by ``fail_peer`` already)."""
        if not st.early or st.peer is None or st.peer.instance_id == msg.src_id:
            return True
        reason = (
            f"{FailReason.PEER_LOST.value}: offer from {msg.src_endpoint} (instance {msg.src_id[:8]}) "
            f"after an early grant to {st.peer.endpoint} (instance {st.peer.instance_id[:8]})"
        )
        self.fail(st.transfer_id, reason, notify=False)
        self.core.send_abort(msg.src_endpoint, st.transfer_id, reason, msg.src_id)
        return False

    def _refused(self, endpoint: str, transfer_id: str) -> None:
        self.core.stats.add("offers_refused")
        self.core.refusals.refused("wrong_peer", f"offer of transfer {transfer_id} from {endpoint}")

    def _check_offer(self, st: RecvState) -> bool:
        assert st.specs is not None
        if st.num_layers != len(st.specs):
            reason = (
                f"{FailReason.MISMATCH.value}: expected {st.num_layers} layers, sender offers {len(st.specs)}"
            )
            self.fail(st.transfer_id, reason, notify=True)
            return False
        total = sum(spec.num_bytes for spec in st.specs)
        if st.sink is None and total > self.core.memory.capacity_bytes:
            reason = f"{FailReason.BUDGET.value}: {total} bytes exceed receive budget + spill pool"
            self.fail(st.transfer_id, reason, notify=True)
            return False
        return True

    def on_trailer(self, msg: Trailer) -> None:
        st = self.table.get(msg.transfer_id)
        if st is None or st.peer is None or st.peer.instance_id != msg.src_id or st.trailer is not None:
            return
        st.trailer = msg.payload
        self.arrivals.ack(st, None, trailer=True)
        self.arrivals.maybe_complete(st)

    def on_abort(self, transfer_id: str, src_id: str, reason: str, src_endpoint: str = "") -> None:
        st = self.table.get(transfer_id)
        if st is None:
            return
        from_sender = st.peer is not None and st.peer.instance_id == src_id
        from_pulled = st.peer is None and st.pull_from is not None
        from_announced = st.peer is None and st.sender is not None and st.sender == src_endpoint
        if from_sender or from_pulled or from_announced:
            self.fail(transfer_id, f"{FailReason.PEER_ABORTED.value}: {reason}", notify=False)

    # --- failure -----------------------------------------------------------------------------------------

    def _released(self, st: RecvState) -> None:
        self.unsolicited.claim(st)
        if st.guard is not None:
            st.guard.close()  # a copy into the caller's blocks running now finishes first
        for granted in st.granted.values():
            if granted is not None:  # a posted receive may still land in it (NCCL: until the
                granted.hand_over()  # cancelled chunk's dummy bytes arrive): never hand it out again
        for buf in st.held.values():  # includes layers in a sink call now (their tensor stays alive)
            buf.release()
        self.arrivals.acks.pop(st.transfer_id, None)

    def _after_failure(self, st: RecvState, reason: str) -> None:
        self.credit.grant_pass()  # its memory went back to the budget

    def fail_peer(self, peer_id: str, reason: str, restarted: bool = False) -> None:
        """The sender ``peer_id`` is gone: fail its transfers, except those whose every layer already
        arrived (a push granted before the caller's ``expect``, held in receive buffers: the data
        is whole, so the ``expect`` that follows completes it; the lease still bounds the wait) and,
        when a new process ``restarted`` at its endpoint, those only granted early to the old one,
        which wait for the new one's Offer. (A broken link of a live sender fails those too: that
        sender may have kept the early grant, whose slot is revoked with the link.)"""
        for tid in self.bound_to(peer_id):
            st = self.table.get(tid)  # (failing one frees memory: the grant pass may fail another)
            if st is None:
                continue
            if restarted and st.early_only(peer_id):
                # the transfer waits for the new process's Offer as if never granted; the plane's
                # posts and grants for the old epoch go with ``drop_peer``, which follows
                self.credit.forget_early(st)
                st.peer = None
            elif not self._all_arrived(st):
                self.fail(tid, reason, notify=False)

    def fail_endpoint(self, endpoint: str, reason: str) -> int:
        """The sender at ``endpoint`` is gone: as :meth:`fail_peer`, by endpoint (also before its
        Offer: a pull, or a push whose sender was named). Returns how many receives failed."""
        failed = 0
        for tid in [t for t, st in self.table.items() if st.peer_endpoint() == endpoint]:
            st = self.table.get(tid)
            if st is not None and not self._all_arrived(st):
                failed += self.fail(tid, reason, notify=False)
        return failed

    def _all_arrived(self, st: RecvState) -> bool:
        """Every layer landed (delivered or held). A trailer still missing will never come from a
        peer that is gone: the transfer then completes without it (the consumer computes P's token)."""
        if not st.all_landed():
            return False
        if st.with_trailer and st.trailer is None:
            st.with_trailer = False
            self.core.stats.add("trailers_missing")
        self.arrivals.maybe_complete(st)
        return True

    def _expiring(self, st: RecvState) -> str | None:
        """Every layer arrived and only the trailer (P's first token) is missing: finish without it
        (the consumer computes that token itself) rather than fail the whole transfer."""
        if st.with_trailer and st.trailer is None:
            st.with_trailer = False
            if st.complete():
                self.core.stats.add("trailers_missing")
                self.arrivals.maybe_complete(st)
                return None
            st.with_trailer = True
        if st.specs is None:
            return "no offer received"
        return f"{len(st.arrived)}/{len(st.specs)} layers received"

    # --- leases ------------------------------------------------------------------------------------------

    def renew_msg(self, endpoint: str, transfer_id: str, reply: bool) -> Renew:
        return Renew(
            **self.core.header(endpoint, transfer_id), state=PeerState.RECEIVING.value, reply=reply
        )

    def on_renew(self, msg: Renew) -> bool:
        """The sender of ``msg.transfer_id`` is alive: extend the lease. True if the transfer is ours."""
        st = self.renewed_by(msg)
        if st is None:
            return False
        if msg.state not in _SENDER_PROGRESS and not self._admitting(st, msg):
            return True  # done, or does not know it: nothing more will come, no renewal
        if st.specs is None:  # before the Offer: the sender's epoch must not change meanwhile
            if st.sender_id is None:
                st.sender_id = msg.src_id
            elif st.sender_id != msg.src_id:
                self.fail(st.transfer_id, f"{FailReason.PEER_LOST.value}: sender restarted", notify=False)
                return True
        st.lease.renewed(self.core.now())
        return True

    def _admitting(self, st: RecvState, msg: Renew) -> bool:
        """A live push sender that has not heard of the transfer yet (its HTTP server or engine queue
        still holds the request: decision 128) renews the lease, within ``max_admission_wait_s`` of
        ``expect`` and before its Offer. Its epoch is pinned like a sender's in progress, so a
        restarted sender (which never had the request) fails the transfer."""
        if msg.state != PeerState.UNKNOWN.value or st.specs is not None or st.pull_from is not None:
            return False
        if not st.expected or st.sender is None:
            return False
        waited = self.core.now() - st.created_s
        if waited <= self.core.config.limits.max_admission_wait_s:
            self.core.stats.add("admission_renewals")
            return True
        return False

    def drop_done(self, transfer_id: str) -> None:
        self.arrivals.drop_done(transfer_id)

    def close(self, reason: str) -> None:
        super().close(reason)
        self.arrivals.close()
