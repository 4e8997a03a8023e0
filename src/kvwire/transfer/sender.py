"""Send half of the agent: offers, credit (grants), dispatch to the data plane, acks, pull leases."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvwire.errors import TransferError
from kvwire.transfer.core import Core
from kvwire.transfer.enums import FailReason
from kvwire.transfer.lease import Lease, PeerState
from kvwire.transfer.messages import Ack, Grant, Offer, Pull, Renew, Trailer, WireLayer
from kvwire.transfer.peer_table import PeerTable
from kvwire.transfer.planes.base import DataPlane
from kvwire.transfer.registered_caches import PagedKV
from kvwire.transfer.split_pull import Split, SplitPulls
from kvwire.transfer.stats import ControlLimit
from kvwire.transfer.types import DTYPE_NAMES, ByteSpans, LayerSpec, PeerRef, SendItem, TransferTiming

SIDE = "send"
MAX_KEPT_PLANE_INFO = 64 * 1024  # an early Grant with a larger plane handshake is not kept (not needed)


def _fits(st: SendState, grant: Grant) -> bool:
    """An early grant (decision 110) is used only if every layer it grants is the size granted."""
    sizes = [st.layers[i].num_bytes if 0 <= i < len(st.layers) else -1 for i in grant.layers]
    return sizes == grant.sizes


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """A layer handed over as blocks of the registered caches, not yet made a plane item."""

    paged: PagedKV
    block_ids: torch.Tensor
    ready_event: Any


@dataclasses.dataclass
class SendState:
    transfer_id: str
    layers: list[LayerSpec]
    lease: Lease  # deadline, renewed while the receiver shows life, up to its limit
    with_trailer: bool
    endpoint: str | None  # receiver's control endpoint; None until pulled
    pull_by: frozenset[str] | None = None  # the only endpoints that may pull (None: the first puller)
    peer: PeerRef | None = None  # bound by the first Grant (receiver's epoch + data address)
    items: dict[int, SendItem | _Blocks] = dataclasses.field(default_factory=dict)  # layers handed over
    granted: set[int] = dataclasses.field(default_factory=set)
    dispatched: set[int] = dataclasses.field(default_factory=set)
    acked: set[int] = dataclasses.field(default_factory=set)
    trailer: bytes | None = None
    trailer_sent: bool = False
    trailer_acked: bool = False
    first_dispatch: float | None = None  # time.monotonic() when the plane got its first layer
    in_plane: int = 0  # layers handed to the plane and not yet reported sent
    busy_since: float = 0.0  # when in_plane last went 0 -> 1
    busy_s: float = 0.0  # total time with in_plane > 0 (TransferTiming.busy_seconds)
    # send_blocks on a device-producer plane: the slab the plane gathers into, and its producer
    slab: torch.Tensor | None = None
    producer: Any | None = None
    paged: PagedKV | None = None  # the caches the slab belongs to (it goes back to their pool)
    last_progress: float = 0.0  # when a layer or the trailer was last handed over (or the start)
    # Piece pulls (split_pull): a held transfer served in pieces, or one piece of such a transfer
    split: Split | None = None
    parent: str | None = None  # a piece: the held transfer's id
    heads: range | None = None  # a piece: the KV heads of the held layers it carries

    def stalled(self, now: float) -> bool:
        """Something is still to be handed over and nothing was for a whole lease: the producer is
        stuck (the receiver must not wait for it past its lease)."""
        missing = len(self.items) < len(self.layers) or (self.with_trailer and self.trailer is None)
        return missing and now - self.last_progress > self.lease.lease_s

    def done(self) -> bool:
        return len(self.acked) == len(self.layers) and (not self.with_trailer or self.trailer_acked)


class Sender:
    """Every method runs with ``core.lock`` held by the caller (the agent)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.sends: dict[str, SendState] = {}
        self.promised: dict[str, tuple[str, Lease]] = {}  # accepted, not started: receiver endpoint
        limits = core.config.limits
        # pulls that came before start_send: transfer id -> (pull, until); bounded per puller and in all
        self.pending_pulls: PeerTable[str, tuple[Pull, float]] = PeerTable(
            limits.max_pending_per_peer, limits.max_pending_pulls, ControlLimit.PENDING_PER_PEER,
            ControlLimit.PENDING_PULLS,
        )  # fmt: skip
        # grants that came before start_send (decision 110): transfer id -> (grant, last heard of)
        self.early_grants: PeerTable[str, tuple[Grant, float]] = PeerTable(
            limits.max_early_grants_per_peer, limits.max_early_grants, ControlLimit.EARLY_GRANTS_PER_PEER,
            ControlLimit.EARLY_GRANTS,
        )  # fmt: skip
        # ordered planes: per receiver epoch, granted (transfer, layer) in grant order
        self.order: dict[str, collections.deque[tuple[str, int]]] = {}
        self.splits = SplitPulls(self)

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
        if transfer_id in self.sends:
            raise TransferError(f"transfer {transfer_id} is already being sent", transfer_id)
        if not 0 < len(layers) <= self.core.config.max_layers_per_transfer:
            raise TransferError(f"a transfer needs 1..{self.core.config.max_layers_per_transfer} layers")
        if len(self.sends) >= self.core.config.max_pending_transfers:
            raise TransferError("too many transfers in flight", transfer_id)
        lease = Lease.start(self.core.now(), deadline_s, limit_s)
        st = SendState(
            transfer_id, list(layers), lease, trailer, endpoint, pull_by, last_progress=self.core.now()
        )
        self.promised.pop(transfer_id, None)
        self.sends[transfer_id] = st
        self.core.stats.add("sends_started")
        if endpoint is not None:
            self.offer(st)
            early = self.early_grants.pop(transfer_id)
            if early is not None and early[0].src_endpoint == endpoint:
                self.on_grant(early[0])  # the receiver granted before this Offer: send at once
            elif early is not None:
                self.core.send_abort(early[0].src_endpoint, transfer_id, "not this transfer's receiver",
                                     early[0].src_id)
            return
        pending = self.pending_pulls.pop(transfer_id)
        if pending is not None:
            self.on_pull(pending[0])
        self.splits.started(st)

    def _check_layer(self, transfer_id: str, index: int) -> SendState | None:
        st = self._get_for_api(transfer_id)
        if st is None:
            return None
        if not 0 <= index < len(st.layers):
            raise TransferError(f"layer {index} out of range 0..{len(st.layers) - 1}", transfer_id)
        if index in st.items:
            raise TransferError(f"layer {index} was already handed over", transfer_id)
        return st

    def add_layer_spans(self, transfer_id: str, index: int, spans: ByteSpans, ready_event: Any) -> None:
        st = self._check_layer(transfer_id, index)
        if st is None:
            return
        spec = st.layers[index]
        if spans.num_bytes != spec.num_bytes:
            raise TransferError(
                f"layer {index}: spans hold {spans.num_bytes} bytes, announced {spec.num_bytes}"
            )
        if self.core.plane.supports_spans:
            st.items[index] = SendItem(transfer_id, index, spans.base, ready_event, spans)
            st.last_progress = self.core.now()
            self.dispatch(st)
            return
        if ready_event is not None:  # order the gather after the producer's writes (CUDA)
            ready_event.wait()
            ready_event = None
        tensor = spans.gather().view(spec.dtype).view(spec.shape)
        if tensor.is_cuda:
            ready_event = torch.cuda.Event()
            ready_event.record()
        self.add_layer(transfer_id, index, tensor, ready_event)

    def add_layer_blocks(
        self, transfer_id: str, index: int, paged: PagedKV, block_ids: torch.Tensor, ready_event: Any
    ) -> None:
        """One layer as blocks of the registered caches. Which way it moves (spans, a device gather,
        a copy) depends on the plane negotiated with the receiver, known for sure only once it granted:
        the layer waits as a :class:`_Blocks` and becomes a :class:`SendItem` at dispatch."""
        st = self._check_layer(transfer_id, index)
        if st is None:
            return
        st.items[index] = _Blocks(paged, block_ids, ready_event)
        st.last_progress = self.core.now()
        self.dispatch(st)

    def _item(self, st: SendState, index: int, plane: DataPlane) -> SendItem:
        """Layer ``index`` as ``plane`` (the one negotiated with the receiver) takes it best."""
        held = st.items[index]
        if isinstance(held, SendItem):
            return held
        paged, block_ids, ready_event = held.paged, held.block_ids, held.ready_event
        tid = st.transfer_id
        if plane.supports_spans and paged.contiguous:
            spans = paged.spans(index, block_ids.tolist())
            item = SendItem(tid, index, spans.base, ready_event, spans)
        elif plane.supports_device_producers and paged.device_paths():
            if st.producer is None:
                from kvwire.transfer.planes.common.group_kernels import PagedLayers, SlabGather

                st.slab = paged.take_slab(int(block_ids.numel()), self._slab_allocator(plane))
                st.paged = paged
                group = paged.group()
                assert isinstance(group, PagedLayers)
                st.producer = SlabGather(group, block_ids.to(paged.device), st.slab)
            assert st.slab is not None
            item = SendItem(tid, index, st.slab[index], ready_event, on_device=st.producer)
        else:
            if ready_event is not None:  # order the gather after the producer's writes (CUDA)
                ready_event.wait()
            tensor = paged.gather(index, block_ids)
            event = None
            if tensor.is_cuda:
                event = torch.cuda.Event()
                event.record()
            item = SendItem(tid, index, tensor, event)
        st.items[index] = item
        return item

    @staticmethod
    def _slab_allocator(plane: DataPlane) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
        """Send slabs from the plane's zero-copy memory where it has some (NCCL moves them in place)."""

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            zero_copy = getattr(plane, "allocate_zero_copy", None)
            flat = zero_copy(num_bytes) if zero_copy is not None else plane.allocate(num_bytes)
            return flat.view(dtype).view(shape)

        return allocate

    def add_layer(self, transfer_id: str, index: int, tensor: torch.Tensor, ready_event: Any) -> None:
        st = self._check_layer(transfer_id, index)
        if st is None:
            return
        spec = st.layers[index]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype or not tensor.is_contiguous():
            raise TransferError(
                f"layer {index}: got {tuple(tensor.shape)} {tensor.dtype} "
                f"(contiguous={tensor.is_contiguous()}), announced {spec.shape} {spec.dtype}",
                transfer_id,
            )
        st.items[index] = SendItem(transfer_id, index, tensor, ready_event)
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

    def _get_for_api(self, transfer_id: str) -> SendState | None:
        st = self.sends.get(transfer_id)
        if st is None and self.core.tombstones.get(SIDE, transfer_id) is None:
            raise TransferError(f"unknown transfer {transfer_id} (start_send first)", transfer_id)
        return st  # None: it already ended (failed/aborted): the caller sees that in poll()

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
        st = self.sends.get(msg.transfer_id)
        if st is None and msg.early and self._keep_early(msg):
            return
        if st is not None and msg.early and not _fits(st, msg):
            return  # the layers are not the sizes granted early: the receiver grants on the Offer
        if st is None or st.endpoint != msg.src_endpoint:
            if st is None and msg.plane_info:  # an ordered plane must still consume what was granted
                self.core.plane.cancel(msg.transfer_id)
                peer = PeerRef(msg.src_endpoint, msg.src_id, msg.data_address, msg.plane_info)
                self.core.plane.on_peer_info(peer, msg.plane_info)
            self._unknown(msg.src_endpoint, msg.transfer_id, msg.src_id)
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
        if self.core.plane.ordered:
            queue = self.order.setdefault(st.peer.instance_id, collections.deque())
            queue.extend((st.transfer_id, i) for i in new)
        self.dispatch(st)

    def on_ack(self, msg: Ack) -> None:
        st = self.sends.get(msg.transfer_id)
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
        del self.sends[st.transfer_id]
        if st.slab is not None and st.paged is not None:
            st.paged.give_slab(st.slab)  # the plane is done with it (a failed send's is dropped)
        self.core.stats.add("sends_completed")
        self.core.tombstones.add(SIDE, st.transfer_id, "done")
        if st.parent is not None:  # a piece: its held transfer reports once all pieces are done
            self.splits.child_done(st, self._timing(st))
            return
        self.core.events.sent(st.transfer_id, self._timing(st))

    def on_pull(self, msg: Pull) -> None:
        if msg.held:
            self.splits.on_pull(msg)
            return
        st = self.sends.get(msg.transfer_id)
        if st is None:
            self._hold_pull(msg)
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

    def _hold_pull(self, msg: Pull) -> None:
        """A pull overtook start_send: hold it until the puller's (clamped) deadline, unless the
        transfer already ended here or the puller (or everyone) has too many held (refused)."""
        ended = self.core.tombstones.get(SIDE, msg.transfer_id)
        limit = None if ended is not None else self.pending_pulls.admit(msg.transfer_id, msg.src_endpoint)
        if ended is not None or limit is not None:
            if limit is not None:
                self.core.stats.limit_hit(limit)
            reason = ended or f"too many pending pulls ({limit.value if limit else ''})"
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)
            return
        until = self.core.now() + self.core.peer_deadline(msg.deadline_s)
        self.pending_pulls.put(msg.transfer_id, msg.src_endpoint, (msg, until))

    def _keep_early(self, msg: Grant) -> bool:
        """Keep an early grant of a transfer not started yet (True), unless it already ended here,
        is not the shape of one (more layers than a transfer has, sizes that do not match them, an
        outsized plane handshake) or too many are kept (False: answered as an unknown transfer; the
        receiver grants again on the Offer)."""
        if self.core.tombstones.get(SIDE, msg.transfer_id) is not None:
            return False
        shaped = len(msg.layers) == len(msg.sizes) <= self.core.config.max_layers_per_transfer
        if not shaped or len(msg.plane_info) > MAX_KEPT_PLANE_INFO:
            return False
        limit = self.early_grants.admit(msg.transfer_id, msg.src_endpoint)
        if limit is not None:
            self.core.stats.limit_hit(limit)
            return False
        self.early_grants.put(msg.transfer_id, msg.src_endpoint, (msg, self.core.now()))
        return True

    def heard_early(self, msg: Renew) -> bool:
        """The receiver of an early grant kept here renews its transfer: it still waits for it."""
        early = self.early_grants.get(msg.transfer_id)
        if early is None or early[0].src_endpoint != msg.src_endpoint:
            return False
        self.early_grants.put(msg.transfer_id, msg.src_endpoint, (early[0], self.core.now()))
        return True

    def _unknown(self, endpoint: str, transfer_id: str, dst_id: str) -> None:
        reason = self.core.tombstones.get(SIDE, transfer_id) or FailReason.UNKNOWN.value
        if reason != "done":
            self.core.send_abort(endpoint, transfer_id, reason, dst_id)

    # --- data --------------------------------------------------------------------------------------------

    def _timing(self, st: SendState) -> TransferTiming | None:
        if st.first_dispatch is None:
            return None
        num_bytes = sum(spec.num_bytes for spec in st.layers)
        return TransferTiming(num_bytes, self.core.now() - st.first_dispatch, st.busy_s)

    def _handed(self, st: SendState, count: int) -> None:
        now = self.core.now()
        if st.first_dispatch is None:
            st.first_dispatch = now
        if st.in_plane == 0:
            st.busy_since = now
        st.in_plane += count

    def dispatch(self, st: SendState) -> None:
        if st.split is not None:  # a held transfer served in pieces: they get the layer
            self.splits.layer_added(st)
        if st.peer is None:
            return
        if self.core.plane.ordered:
            self._dispatch_ordered(st.peer)
            return
        ready = sorted(i for i in st.granted if i in st.items and i not in st.dispatched)
        if ready:
            plane = self.core.plane.for_peer(st.peer)
            items = [self._item(st, i, plane) for i in ready]
            self._handed(st, len(ready))
            st.dispatched.update(ready)
            self.core.plane.send(st.peer, items)

    def _dispatch_ordered(self, peer: PeerRef) -> None:
        queue = self.order.get(peer.instance_id)
        batch: list[SendItem] = []
        while queue:
            tid, index = queue[0]
            st = self.sends.get(tid)
            if st is not None and index not in st.items:
                break  # the plane needs this layer next: hold the later ones
            queue.popleft()
            if st is not None:
                self._handed(st, 1)
                st.dispatched.add(index)
                batch.append(self._item(st, index, self.core.plane.for_peer(peer)))
        if queue is not None and not queue:
            del self.order[peer.instance_id]  # one entry per receiver epoch with granted work, no more
        if batch:
            self.core.plane.send(peer, batch)

    def on_sent(self, transfer_id: str, index: int) -> None:
        st = self.sends.get(transfer_id)
        if st is not None and st.in_plane > 0:
            st.in_plane -= 1
            if st.in_plane == 0:
                st.busy_s += self.core.now() - st.busy_since

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
        given, is what it is told; the local reason otherwise)."""
        st = self.sends.pop(transfer_id, None)
        if st is None:
            return False
        self.core.plane.cancel(transfer_id)
        self.core.record_failure(SIDE, transfer_id, reason, label)
        if notify and st.endpoint is not None:
            dst = st.peer.instance_id if st.peer is not None else None
            self.core.send_abort(st.endpoint, transfer_id, wire_reason or reason, dst)
        if st.peer is not None and self.core.plane.ordered:
            self._dispatch_ordered(st.peer)
        if st.parent is not None:
            self.splits.child_failed(st, reason)
        self.splits.parent_failed(st, reason)
        return True

    def fail_peer(self, peer_id: str, reason: str) -> None:
        for tid in [
            t for t, st in self.sends.items() if st.peer is not None and st.peer.instance_id == peer_id
        ]:
            self.fail(tid, reason, notify=False)
        self.order.pop(peer_id, None)

    def fail_endpoint(self, endpoint: str, reason: str) -> int:
        """The receiver at ``endpoint`` is gone: fail what is sent to it, drop what is promised.
        Returns how many sends failed."""
        gone = [t for t, st in self.sends.items() if st.endpoint == endpoint]
        for tid in gone:
            self.fail(tid, reason, notify=False)
        for tid in [t for t, (e, _) in self.promised.items() if e == endpoint]:
            del self.promised[tid]
        return len(gone)

    def on_abort(self, transfer_id: str, src_endpoint: str, reason: str) -> None:
        early = self.early_grants.get(transfer_id)
        if early is not None and early[0].src_endpoint == src_endpoint:
            self.early_grants.pop(transfer_id)
        st = self.sends.get(transfer_id)
        if st is not None and st.endpoint == src_endpoint:
            self.fail(transfer_id, f"{FailReason.PEER_ABORTED.value}: {reason}", notify=False)

    def expire(self, now: float) -> None:
        for tid in [t for t, st in self.sends.items() if st.lease.deadline <= now]:
            st = self.sends.get(tid)
            if st is None or self.splits.keeps_lease(st):
                continue  # ended with an expired piece, or every piece pulled: the pieces' leases bound it
            what = f"{len(st.acked)}/{len(st.layers)} layers acknowledged"
            if st.split is not None:
                what = f"{len(st.split.children)} of {st.split.pieces} pieces pulled"
            elif st.endpoint is None:
                what = "not pulled"
            self.fail(tid, f"{FailReason.DEADLINE.value}: {what}", notify=True)
        for tid, (msg, until) in self.pending_pulls.items():
            if until <= now:
                self.pending_pulls.pop(tid)
                self.core.send_abort(msg.src_endpoint, tid, FailReason.UNKNOWN.value, msg.src_id)
        # an early grant lives while its receiver renews it (it renews well within its deadline)
        quiet = self.core.config.default_deadline_s
        for tid, (_, heard) in self.early_grants.items():
            if now - heard > quiet:
                self.early_grants.pop(tid)
        self.splits.expire(now)

    # --- leases ------------------------------------------------------------------------------------------

    def renew(self, now: float) -> None:
        """Send a Renew to the receiver of every transfer (or promise) whose renewal is due; drop
        promises past their limit (a request that never started)."""
        for st in self.sends.values():
            if st.endpoint is not None and st.lease.due(now):
                self.core.send(st.endpoint, self.renew_msg(st.endpoint, st.transfer_id, reply=False))
        for tid in [t for t, (_, lease) in self.promised.items() if lease.limit <= now]:
            del self.promised[tid]
        for tid, (endpoint, lease) in self.promised.items():
            if lease.due(now):
                msg = Renew(**self.core.header(endpoint, tid), state=PeerState.QUEUED.value, reply=False)
                self.core.send(endpoint, msg)

    def renew_msg(self, endpoint: str, transfer_id: str, reply: bool) -> Renew:
        st = self.sends.get(transfer_id)
        stalled = st is not None and st.stalled(self.core.now())
        state = PeerState.STALLED if stalled else PeerState.SENDING
        return Renew(**self.core.header(endpoint, transfer_id), state=state.value, reply=reply)

    def on_renew(self, msg: Renew) -> bool:
        """The receiver of ``msg.transfer_id`` is alive: extend the lease. True if the transfer is ours."""
        st = self.sends.get(msg.transfer_id)
        if st is None or st.endpoint != msg.src_endpoint:
            return False
        if st.peer is not None and st.peer.instance_id != msg.src_id:
            return False  # an older or newer epoch of the receiver: epoch checks handle it
        if msg.state == PeerState.DONE.value and st.peer is not None:
            # the receiver finished (e.g. without a trailer that came too late): so did we
            self._complete(st)
            return True
        now = self.core.now()
        if msg.state == PeerState.RECEIVING.value and not st.stalled(now):
            st.lease.renewed(now)
        return True

    def promise(self, transfer_id: str, endpoint: str, deadline_s: float, limit_s: float | None) -> None:
        """The request behind ``transfer_id`` was accepted (its prefill may be queued): renew the
        receiver's lease (state QUEUED) until ``start``, ``forget`` or the limit."""
        if transfer_id in self.sends or transfer_id in self.promised or self.core.tombstones.get(
            SIDE, transfer_id
        ) is not None:
            return
        if len(self.promised) >= self.core.config.max_pending_transfers:
            raise TransferError("too many promised transfers", transfer_id)
        lease = Lease.start(self.core.now(), deadline_s, limit_s)
        lease.next_renew = 0.0  # tell the receiver at once
        self.promised[transfer_id] = (endpoint, lease)

    def forget(self, transfer_id: str, reason: str) -> None:
        """Drop a promise (the request ended before its send started): the receiver is told at once
        and later renewals of it are answered with an Abort."""
        entry = self.promised.pop(transfer_id, None)
        if entry is not None:
            self.core.send_abort(entry[0], transfer_id, reason)
            self.core.tombstones.add(SIDE, transfer_id, reason)

    def on_promise_renew(self, msg: Renew) -> bool:
        """True if ``msg`` is about a transfer promised to its sender (promises live until start,
        abort or their limit: this side's own word, whatever the receiver says)."""
        entry = self.promised.get(msg.transfer_id)
        return entry is not None and entry[0] == msg.src_endpoint

    def close(self, reason: str) -> None:
        self.early_grants.clear()
        for tid in list(self.sends):
            self.fail(tid, reason, notify=True)
