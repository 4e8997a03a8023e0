"""Send side of the agent: offers, grants taken, layers handed over, acks, pulls, renewals, failures.

A transfer is a :class:`~kvwire.transfer.send_state.SendState`; handing granted layers to the plane is
``send_state.SendQueue``; promises (accepted, not started) ``lease.Promises``;
early grants kept before the start :mod:`kvwire.transfer.grants`; piece pulls
:mod:`kvwire.transfer.split_pull`; leases, expiry and the one ``fail`` ``core.Transfers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvwire.errors import TransferError
from kvwire.transfer.control_messages import Ack, Grant, Offer, Pull, Renew, Trailer, WireLayer
from kvwire.transfer.core import Core, Transfers
from kvwire.transfer.enums import FailReason
from kvwire.transfer.grants import EarlyGrants, early_grant_fits
from kvwire.transfer.lease import Lease, PeerState, Promises
from kvwire.transfer.pending_pulls import PendingPulls
from kvwire.transfer.registered_caches import PagedKV
from kvwire.transfer.send_state import HeldBlocks, SendQueue, SendState, gathered
from kvwire.transfer.split_pull import Piece, SplitPulls
from kvwire.transfer.types import DTYPE_NAMES, ByteSpans, LayerSpec, PeerRef, SendItem

SIDE = "send"


class Sender(Transfers[SendState]):
    """Every method runs with ``core.lock`` held by the caller (the agent)."""

    side = SIDE

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.promises = Promises(core)
        self.pending_pulls = PendingPulls(core)  # pulls that came before start_send
        self.early_grants = EarlyGrants(core)  # grants that came before start_send (decision 110)
        self.queue = SendQueue(core, self.table)
        self.splits = SplitPulls(self)

    @property
    def sends(self) -> dict[str, SendState]:
        return self.table

    # --- API ---------------------------------------------------------------------------------------------

    def start(
        self,
        transfer_id: str,
        endpoint: str | None,
        layers: Sequence[LayerSpec],
        deadline_s: float,
        trailer: bool,
        pull_by: frozenset[str] | None = None,
        limit_s: float | None = None,
    ) -> None:
        if not transfer_id:
            raise TransferError("transfer_id must not be empty")
        if transfer_id in self.table:
            raise TransferError(f"transfer {transfer_id} is already being sent", transfer_id)
        if not 0 < len(layers) <= self.core.config.max_layers_per_transfer:
            raise TransferError(f"a transfer needs 1..{self.core.config.max_layers_per_transfer} layers")
        if len(self.table) >= self.core.config.max_pending_transfers:
            raise TransferError("too many transfers in flight", transfer_id)
        lease = Lease.start(self.core.now(), deadline_s, limit_s)
        st = SendState(
            transfer_id, lease, list(layers), trailer, endpoint, pull_by, last_progress=self.core.now()
        )
        self.promises.started(transfer_id)
        self.table[transfer_id] = st
        self.core.stats.add("sends_started")
        if endpoint is not None:
            self.offer(st)
            early = self.early_grants.take(transfer_id)
            if early is not None and early.src_endpoint == endpoint:
                self.on_grant(early)  # the receiver granted before this Offer: send at once
            elif early is not None:
                reason = "not this transfer's receiver"
                self.core.send_abort(early.src_endpoint, transfer_id, reason, early.src_id)
            return
        pending = self.pending_pulls.take(transfer_id)
        if pending is not None:
            self.on_pull(pending)
        self.splits.started(st)

    def add_layer_spans(self, transfer_id: str, index: int, spans: ByteSpans, ready_event: Any) -> None:
        st = self._get_for_api(transfer_id, index)
        if st is None:
            return
        spec = st.layers[index]
        if spans.num_bytes != spec.num_bytes:
            raise TransferError(
                f"layer {index}: spans hold {spans.num_bytes} bytes, announced {spec.num_bytes}"
            )
        if self.core.plane.supports_spans:
            self._handed_over(st, index, SendItem(transfer_id, index, spans.base, ready_event, spans))
        else:  # the plane takes tensors only: gather here
            self.add_layer(transfer_id, index, *gathered(spans, spec, ready_event))

    def add_layer_blocks(
        self, transfer_id: str, index: int, paged: PagedKV, block_ids: torch.Tensor, ready_event: Any
    ) -> None:
        """One layer as blocks of the registered caches. Which way it moves (spans, a device gather,
        a copy) depends on the plane negotiated with the receiver, known for sure only once it granted:
        the layer waits as a :class:`HeldBlocks` and becomes a :class:`SendItem` at dispatch."""
        st = self._get_for_api(transfer_id, index)
        if st is not None:
            self._handed_over(st, index, HeldBlocks(paged, block_ids, ready_event))

    def add_layer(self, transfer_id: str, index: int, tensor: torch.Tensor, ready_event: Any) -> None:
        st = self._get_for_api(transfer_id, index)
        if st is not None:
            st.check_tensor(index, tensor)
            self._handed_over(st, index, SendItem(transfer_id, index, tensor, ready_event))

    def _handed_over(self, st: SendState, index: int, item: SendItem | HeldBlocks) -> None:
        st.items[index] = item
        st.last_progress = self.core.now()
        self.dispatch(st)

    def add_trailer(self, transfer_id: str, payload: bytes) -> None:
        st = self._get_for_api(transfer_id)
        if st is None:
            return
        if not st.with_trailer or st.trailer is not None:
            raise TransferError("trailer not announced (with_trailer=False) or already sent", transfer_id)
        st.trailer = bytes(payload)
        st.last_progress = self.core.now()
        self._send_trailer(st)

    def _get_for_api(self, transfer_id: str, layer_index: int | None = None) -> SendState | None:
        """The transfer a caller hands something to (``layer_index``: a layer it may take now)."""
        st = self.table.get(transfer_id)
        if st is None and self.core.tombstones.get(SIDE, transfer_id) is None:
            raise TransferError(f"unknown transfer {transfer_id} (start_send first)", transfer_id)
        if st is not None and layer_index is not None:
            st.check_layer(layer_index)
        return st  # None: it already ended (failed/aborted): the caller sees that in poll()

    def promise(self, transfer_id: str, endpoint: str, deadline_s: float, limit_s: float | None) -> None:
        """See :meth:`kvwire.transfer.promises.Promises.promise`."""
        self.promises.promise(transfer_id, endpoint, deadline_s, limit_s, transfer_id in self.table)

    # --- messages ----------------------------------------------------------------------------------------

    def offer(self, st: SendState) -> None:
        assert st.endpoint is not None
        core = self.core
        peer_id = core.peer_ids.get(st.endpoint)
        info = core.plane.local_info(PeerRef(st.endpoint, peer_id, ""))
        msg = Offer(
            **core.header(st.endpoint, st.transfer_id),
            layers=[WireLayer(list(spec.shape), DTYPE_NAMES[spec.dtype]) for spec in st.layers],
            with_trailer=st.with_trailer,
            deadline_s=st.lease.lease_s,
            data_address=core.plane.address,
            plane_info=info,
        )
        core.send(st.endpoint, msg)
        self._send_trailer(st)

    def _send_trailer(self, st: SendState) -> None:
        if st.trailer is None or st.trailer_sent or st.endpoint is None:
            return
        st.trailer_sent = True
        self.core.send(
            st.endpoint, Trailer(**self.core.header(st.endpoint, st.transfer_id), payload=st.trailer)
        )

    def on_grant(self, msg: Grant) -> None:
        st = self.table.get(msg.transfer_id)
        ended = self.core.tombstones.get(SIDE, msg.transfer_id) is not None
        if st is None and msg.early and self.early_grants.keep(msg, ended):
            return
        if st is not None and msg.early and not early_grant_fits(st.layers, msg):
            return  # the layers are not the sizes granted early: the receiver grants on the Offer
        if st is None or st.endpoint != msg.src_endpoint:
            self._grant_of_unknown(msg, started=st is not None)
            return
        if st.peer is None:
            st.peer = PeerRef(msg.src_endpoint, msg.src_id, msg.data_address, msg.plane_info)
        elif st.peer.instance_id != msg.src_id:
            self.fail(st.transfer_id, f"{FailReason.PEER_LOST.value}: receiver restarted mid-transfer", True)
            return
        # (once each: a layer a peer names twice must not be queued twice on an ordered plane)
        new = list(dict.fromkeys(i for i in msg.layers if 0 <= i < len(st.layers) and i not in st.granted))
        # every grant: the NCCL plane's chunk plans for these layers travel here (a repeated early
        # grant, decision 110, grants nothing new and its destinations were taken already)
        if msg.plane_info and new:
            self.core.plane.on_peer_info(st.peer, msg.plane_info)
        st.granted.update(new)
        self.queue.granted(st, new)
        self.dispatch(st)

    def on_ack(self, msg: Ack) -> None:
        st = self.table.get(msg.transfer_id)
        if st is None or st.peer is None or st.peer.instance_id != msg.src_id:
            return  # late ack of an ended transfer
        new = {i for i in msg.layers if i in st.dispatched} - st.acked
        st.acked.update(new)
        # counted on the receiver's word, not the plane's on_sent: an ack may overtake the writer
        # thread's on_sent, and the transfer then completes before on_sent could count it
        self.core.stats.add("bytes_sent", sum(st.layers[i].num_bytes for i in new))
        st.trailer_acked = st.trailer_acked or (msg.trailer and st.trailer_sent)
        if st.done():
            self._complete(st)

    def _complete(self, st: SendState) -> None:
        del self.table[st.transfer_id]
        if st.slab is not None and st.paged is not None:
            st.paged.give_slab(st.slab)  # the plane is done with it (a failed send's is dropped)
        self.core.stats.add("sends_completed")
        self.core.tombstones.add(SIDE, st.transfer_id, "done")
        timing = self.queue.timing(st)
        if isinstance(st, Piece):  # its held transfer reports once all its pieces are done
            self.splits.piece_done(st, timing)
        else:
            self.core.events.sent(st.transfer_id, timing)

    def on_pull(self, msg: Pull) -> None:
        if msg.held:
            self.splits.on_pull(msg)
            return
        st = self.table.get(msg.transfer_id)
        if st is None:
            self.pending_pulls.hold(msg)
            return
        if st.endpoint is None and st.pull_by is not None and msg.src_endpoint not in st.pull_by:
            self.core.stats.add("offers_refused")  # not the pair's receiver: the lease stays
            detail = f"pull of transfer {msg.transfer_id} from {msg.src_endpoint}"
            self.core.refusals.refused("wrong_peer", detail)
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, "not this transfer's peer", msg.src_id)
        elif st.endpoint is None and st.split is not None:
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, "pulled in pieces", msg.src_id)
        elif st.endpoint is None:
            st.endpoint = msg.src_endpoint
            self.offer(st)
        elif st.endpoint != msg.src_endpoint:
            self.core.send_abort(
                msg.src_endpoint, msg.transfer_id, "already pulled by another peer", msg.src_id
            )

    def _grant_of_unknown(self, msg: Grant, started: bool) -> None:
        """A grant of a transfer not sent here (or not to its sender): answered with an Abort unless
        the transfer finished here."""
        if not started and msg.plane_info:  # an ordered plane must still consume what was granted
            self.core.plane.cancel(msg.transfer_id)
            peer = PeerRef(msg.src_endpoint, msg.src_id, msg.data_address, msg.plane_info)
            self.core.plane.on_peer_info(peer, msg.plane_info)
        reason = self.core.tombstones.get(SIDE, msg.transfer_id) or FailReason.UNKNOWN.value
        if reason != "done":
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)

    def on_abort(self, transfer_id: str, src_endpoint: str, reason: str) -> None:
        self.early_grants.aborted(transfer_id, src_endpoint)
        st = self.table.get(transfer_id)
        if st is not None and st.endpoint == src_endpoint:
            self.fail(transfer_id, f"{FailReason.PEER_ABORTED.value}: {reason}", notify=False)

    # --- data --------------------------------------------------------------------------------------------

    def dispatch(self, st: SendState) -> None:
        if st.split is not None:  # a held transfer served in pieces: they get the layer
            self.splits.layer_added(st)
        self.queue.dispatch(st)

    # --- failure -----------------------------------------------------------------------------------------

    def _after_failure(self, st: SendState, reason: str) -> None:
        if st.peer is not None and self.core.plane.ordered:
            self.queue.dispatch_ordered(st.peer)
        if isinstance(st, Piece) or st.split is not None:
            self.splits.failed(st, reason)

    def fail_peer(self, peer_id: str, reason: str) -> None:
        for tid in self.bound_to(peer_id):
            self.fail(tid, reason, notify=False)
        self.queue.drop_peer(peer_id)

    def fail_endpoint(self, endpoint: str, reason: str) -> int:
        """The receiver at ``endpoint`` is gone: fail what is sent to it, drop what is promised.
        Returns how many sends failed."""
        gone = [t for t, st in self.table.items() if st.endpoint == endpoint]
        for tid in gone:
            self.fail(tid, reason, notify=False)
        self.promises.drop_endpoint(endpoint)
        return len(gone)

    def expire(self, now: float) -> None:
        super().expire(now)
        self.pending_pulls.expire(now)
        self.early_grants.expire(now)
        self.splits.expire(now)

    def _expiring(self, st: SendState) -> str | None:
        if self.splits.keeps_lease(st):
            return None  # every piece pulled: the pieces' leases bound it
        if st.split is not None:
            return f"{len(st.split.children)} of {st.split.pieces} pieces pulled"
        if st.endpoint is None:
            return "not pulled"
        return f"{len(st.acked)}/{len(st.layers)} layers acknowledged"

    # --- leases ------------------------------------------------------------------------------------------

    def renew(self, now: float) -> None:
        """Send a Renew to the receiver of every transfer (or promise) whose renewal is due; drop
        promises past their limit (a request that never started)."""
        super().renew(now)
        self.promises.renew(now)

    def renew_msg(self, endpoint: str, transfer_id: str, reply: bool) -> Renew:
        st = self.table.get(transfer_id)
        stalled = st is not None and st.stalled(self.core.now())
        state = PeerState.STALLED if stalled else PeerState.SENDING
        return Renew(**self.core.header(endpoint, transfer_id), state=state.value, reply=reply)

    def on_renew(self, msg: Renew) -> bool:
        """The receiver of ``msg.transfer_id`` is alive: extend the lease. True if the transfer is ours."""
        st = self.renewed_by(msg)
        if st is None:
            return False
        if msg.state == PeerState.DONE.value and st.peer is not None:
            # the receiver finished (e.g. without a trailer that came too late): so did we
            self._complete(st)
            return True
        now = self.core.now()
        if msg.state == PeerState.RECEIVING.value and not st.stalled(now):
            st.lease.renewed(now)
        return True

    def close(self, reason: str) -> None:
        self.early_grants.clear()
        super().close(reason)
