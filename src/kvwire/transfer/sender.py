"""Send side of the agent: one transfer's state and the queue to the plane, promises and early grants
kept before the start, pulls in pieces, and the side itself.

Read in order: a send's state and :class:`SendQueue`; :class:`Promises` (decision 123);
:class:`EarlyGrants` (decision 110);
split pulls (a held transfer served in pieces); the :class:`Sender` (offers, grants, layers
handed over, acks, pulls, renewals, failures).

A send's state and the queue to the plane
-----------------------------------------
One transfer on the send side: its layers as handed over, granted, dispatched and acknowledged;
and the side's queue of granted layers to the data plane (:class:`SendQueue`).

An ordered plane (NCCL) takes a receiver's layers in the order it granted them: they wait in that
order, per receiver epoch, and a layer not handed over yet holds the later ones back. Every method
runs with ``core.lock`` held.

Early grants
------------
The send side keeps an early grant of a transfer it has not started yet (:class:`EarlyGrants`),
bounded per receiver and in all, while that receiver renews it. Every method runs with ``core.lock``.

Pulls in pieces
---------------
Pull mode, one held transfer served in pieces to several receivers (docs/decisions/087).

P and D of different tensor-parallel sizes: in pull mode P holds each rank's whole layer (its
registered paged cache, blocks pinned) without knowing D's size; every D rank that needs heads of it
pulls its own *piece*: a :class:`~kvwire.transfer.wire.Pull` naming the held transfer, its own
transfer id for the piece, the head range it owns and how many pieces the held transfer serves in
all. Each piece becomes a *child* send (a :class:`Piece`: a
:class:`~kvwire.transfer.sender.SendState` bound to that receiver: offer, credit, leases, acks as
any send) whose layers are the held blocks narrowed to the piece's heads, so no receiver gets bytes
it throws away.

The held transfer (the *parent*) is reported to the caller once: finished when every one of its
``pieces`` children was acknowledged; failed as soon as one child fails (the other children are
then failed too, their receivers told), or when not every piece was pulled by the parent's lease.
Once all pieces are pulled, the children's leases (renewed by their receivers) bound the wait.

A release (``pieces == 0``) ends a held transfer nobody needs (a replica of KV heads another P rank
serves) as finished at once. Every method runs with ``core.lock`` held (the sender's caller).

The send side
-------------
Send side of the agent: offers, grants taken, layers handed over, acks, pulls, renewals, failures.

A transfer is a :class:`SendState`; handing granted layers to the plane is :class:`SendQueue`;
promises (accepted, not started) :class:`Promises`; early grants kept before the start
:class:`EarlyGrants`; piece pulls :class:`SplitPulls`; leases, expiry and the one ``fail``
``core.Transfers``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvwire.errors import TransferError
from kvwire.transfer.core import MIN_RENEW_S, Core, Lease, PeerState, Transfers, TransferState
from kvwire.transfer.enums import FailReason, KVLayout
from kvwire.transfer.memory import (
    DTYPE_NAMES,
    HEAD_DIM,
    ByteSpans,
    LayerSpec,
    PagedKV,
    PeerRef,
    SendItem,
    TransferTiming,
)
from kvwire.transfer.pending_pulls import PendingPulls
from kvwire.transfer.planes.base import DataPlane
from kvwire.transfer.wire import (
    Ack,
    ControlLimit,
    Grant,
    Offer,
    PeerTable,
    Pull,
    Renew,
    Trailer,
    WireLayer,
)

SIDE = "send"  # this side's key in the tombstones


# ============================== A send's state and the queue to the plane

@dataclasses.dataclass(frozen=True)
class HeldBlocks:
    """A layer handed over as blocks of the registered caches, not yet made a plane item."""

    paged: PagedKV
    block_ids: torch.Tensor
    ready_event: Any


@dataclasses.dataclass
class SendState(TransferState):
    layers: list[LayerSpec]
    with_trailer: bool
    endpoint: str | None  # receiver's control endpoint; None until pulled
    pull_by: frozenset[str] | None = None  # the only endpoints that may pull (None: the first puller)
    peer: PeerRef | None = None  # bound by the first Grant (receiver's epoch + data address)
    items: dict[int, SendItem | HeldBlocks] = dataclasses.field(default_factory=dict)  # layers handed over
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
    split: Split | None = None  # a held transfer served in pieces (split_pull)

    @property
    def bound_peer(self) -> PeerRef | None:
        return self.peer

    def peer_endpoint(self) -> str | None:
        return self.endpoint

    def stalled(self, now: float) -> bool:
        """Something is still to be handed over and nothing was for a whole lease: the producer is
        stuck (the receiver must not wait for it past its lease)."""
        missing = len(self.items) < len(self.layers) or (self.with_trailer and self.trailer is None)
        return missing and now - self.last_progress > self.lease.lease_s

    def done(self) -> bool:
        return len(self.acked) == len(self.layers) and (not self.with_trailer or self.trailer_acked)

    def check_layer(self, index: int) -> None:
        """Layer ``index`` may be handed over now (in range, not yet handed over)."""
        if not 0 <= index < len(self.layers):
            raise TransferError(f"layer {index} out of range 0..{len(self.layers) - 1}", self.transfer_id)
        if index in self.items:
            raise TransferError(f"layer {index} was already handed over", self.transfer_id)

    def check_tensor(self, index: int, tensor: torch.Tensor) -> None:
        """``tensor`` is layer ``index`` as announced (shape, dtype, contiguous)."""
        spec = self.layers[index]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype or not tensor.is_contiguous():
            raise TransferError(
                f"layer {index}: got {tuple(tensor.shape)} {tensor.dtype} "
                f"(contiguous={tensor.is_contiguous()}), announced {spec.shape} {spec.dtype}",
                self.transfer_id,
            )

    def item(self, index: int, plane: DataPlane) -> SendItem:
        """Layer ``index`` as ``plane`` (the one negotiated with the receiver) takes it best."""
        held = self.items[index]
        if isinstance(held, SendItem):
            return held
        paged, block_ids, ready_event = held.paged, held.block_ids, held.ready_event
        tid = self.transfer_id
        if plane.supports_spans and paged.contiguous:
            spans = paged.spans(index, block_ids.tolist())
            item = SendItem(tid, index, spans.base, ready_event, spans)
        elif plane.supports_device_producers and paged.device_paths():
            if self.producer is None:
                from kvwire.transfer.planes.common.group_kernels import PagedLayers, SlabGather

                self.slab = paged.take_slab(int(block_ids.numel()), _slab_allocator(plane))
                self.paged = paged
                group = paged.group()
                assert isinstance(group, PagedLayers)
                self.producer = SlabGather(group, block_ids.to(paged.device), self.slab)
            assert self.slab is not None
            item = SendItem(tid, index, self.slab[index], ready_event, on_device=self.producer)
        else:
            if ready_event is not None:  # order the gather after the producer's writes (CUDA)
                ready_event.wait()
            tensor = paged.gather(index, block_ids)
            event = None
            if tensor.is_cuda:
                event = torch.cuda.Event()
                event.record()
            item = SendItem(tid, index, tensor, event)
        self.items[index] = item
        return item


def _slab_allocator(plane: DataPlane) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    """Send slabs from the plane's zero-copy memory where it has some (NCCL moves them in place)."""

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        zero_copy = getattr(plane, "allocate_zero_copy", None)
        flat = zero_copy(num_bytes) if zero_copy is not None else plane.allocate(num_bytes)
        return flat.view(dtype).view(shape)

    return allocate


def gathered(spans: ByteSpans, spec: LayerSpec, ready_event: Any) -> tuple[torch.Tensor, Any]:
    """A layer's ``spans`` gathered into one tensor (for a plane that takes no spans), and the event
    that orders its use after the gather (CUDA; None on the CPU)."""
    if ready_event is not None:  # order the gather after the producer's writes (CUDA)
        ready_event.wait()
        ready_event = None
    tensor = spans.gather().view(spec.dtype).view(spec.shape)
    if tensor.is_cuda:
        ready_event = torch.cuda.Event()
        ready_event.record()
    return tensor, ready_event


class SendQueue:
    """Hands the send side's granted layers to the plane (see the module docstring)."""

    def __init__(self, core: Core, sends: dict[str, SendState]) -> None:
        self.core = core
        self.sends = sends
        # ordered planes: per receiver epoch, granted (transfer, layer) in grant order
        self.order: dict[str, collections.deque[tuple[str, int]]] = {}

    def granted(self, st: SendState, new: Iterable[int]) -> None:
        """Layers ``new`` of ``st`` were granted (once each), in grant order."""
        assert st.peer is not None
        if self.core.plane.ordered:
            queue = self.order.setdefault(st.peer.instance_id, collections.deque())
            queue.extend((st.transfer_id, i) for i in new)

    def dispatch(self, st: SendState) -> None:
        """Hand the plane every layer of ``st`` that is granted and handed over, not yet dispatched."""
        if st.peer is None:
            return
        if self.core.plane.ordered:
            self.dispatch_ordered(st.peer)
            return
        ready = sorted(i for i in st.granted if i in st.items and i not in st.dispatched)
        if ready:
            plane = self.core.plane.for_peer(st.peer)
            items = [st.item(i, plane) for i in ready]
            self._handed(st, len(ready))
            st.dispatched.update(ready)
            self.core.plane.send(st.peer, items)

    def dispatch_ordered(self, peer: PeerRef) -> None:
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
                batch.append(st.item(index, self.core.plane.for_peer(peer)))
        if queue is not None and not queue:
            del self.order[peer.instance_id]  # one entry per receiver epoch with granted work, no more
        if batch:
            self.core.plane.send(peer, batch)

    def _handed(self, st: SendState, count: int) -> None:
        now = self.core.now()
        if st.first_dispatch is None:
            st.first_dispatch = now
        if st.in_plane == 0:
            st.busy_since = now
        st.in_plane += count

    def on_sent(self, transfer_id: str, index: int) -> None:
        st = self.sends.get(transfer_id)
        if st is not None and st.in_plane > 0:
            st.in_plane -= 1
            if st.in_plane == 0:
                st.busy_s += self.core.now() - st.busy_since

    def drop_peer(self, peer_id: str) -> None:
        self.order.pop(peer_id, None)

    def timing(self, st: SendState) -> TransferTiming | None:
        if st.first_dispatch is None:
            return None
        num_bytes = sum(spec.num_bytes for spec in st.layers)
        return TransferTiming(num_bytes, self.core.now() - st.first_dispatch, st.busy_s)


# ============================== Promises

# A promise's first Renew goes this long after it was made (then every ``renew_interval``), not at
# once: a prefill that starts its send sooner (a short prompt on an idle P: most of them) needs none,
# and the Renew and its answer do not wake both control threads while P computes (decision 151).
# Far inside any lease (``renew_interval`` is at least as long); the lease clock leaves out the time
# P did not run, so a stopped P renews after this much of its own running time.
FIRST_PROMISE_RENEW_S = MIN_RENEW_S


class Promises:
    """Promised transfers: accepted by the send side, not started yet (their prefill may be queued).

    :meth:`~kvwire.transfer.agent.TransferAgent.promise` keeps one here until ``start_send``,
    ``abort`` or its limit; meanwhile the receiver's lease on it is renewed (state QUEUED: decision
    123). A promise is this side's own word, whatever the receiver says. Every method runs with
    ``core.lock``. transfer id -> (receiver endpoint, lease)."""

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
        now = self.core.now()
        lease = Lease.start(now, deadline_s, limit_s)
        lease.next_renew = min(lease.next_renew, now + FIRST_PROMISE_RENEW_S)
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


# ============================== Early grants kept by the sender

MAX_KEPT_PLANE_INFO = 64 * 1024  # an early Grant with a larger plane handshake is not kept (not needed)


class EarlyGrants:
    """The send side's early grants of transfers not started yet: transfer id -> (grant, when its
    receiver was last heard of); bounded per receiver and in all (decision 110)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        limits = core.config.limits
        self.table: PeerTable[str, tuple[Grant, float]] = PeerTable(
            limits.max_early_grants_per_peer, limits.max_early_grants, ControlLimit.EARLY_GRANTS_PER_PEER,
            ControlLimit.EARLY_GRANTS,
        )  # fmt: skip

    def keep(self, msg: Grant, ended: bool) -> bool:
        """Keep an early grant of a transfer not started yet (True), unless it already ``ended``
        here, is not the shape of one (more layers than a transfer has, sizes that do not match them,
        an outsized plane handshake) or too many are kept (False: answered as an unknown transfer;
        the receiver grants again on the Offer)."""
        if ended:
            return False
        shaped = len(msg.layers) == len(msg.sizes) <= self.core.config.max_layers_per_transfer
        if not shaped or len(msg.plane_info) > MAX_KEPT_PLANE_INFO:
            return False
        limit = self.table.admit(msg.transfer_id, msg.src_endpoint)
        if limit is not None:
            self.core.stats.limit_hit(limit)
            return False
        self.table.put(msg.transfer_id, msg.src_endpoint, (msg, self.core.now()))
        return True

    def take(self, transfer_id: str) -> Grant | None:
        """The early grant kept for ``transfer_id`` (which starts now), once."""
        entry = self.table.pop(transfer_id)
        return entry[0] if entry is not None else None

    def heard(self, msg: Renew) -> bool:
        """The receiver of an early grant kept here renews its transfer: it still waits for it."""
        early = self.table.get(msg.transfer_id)
        if early is None or early[0].src_endpoint != msg.src_endpoint:
            return False
        self.table.put(msg.transfer_id, msg.src_endpoint, (early[0], self.core.now()))
        return True

    def aborted(self, transfer_id: str, src_endpoint: str) -> None:
        """The receiver of an early grant gave the transfer up: drop the grant."""
        early = self.table.get(transfer_id)
        if early is not None and early[0].src_endpoint == src_endpoint:
            self.table.pop(transfer_id)

    def expire(self, now: float) -> None:
        """An early grant lives while its receiver renews it (it renews well within its deadline)."""
        quiet = self.core.config.default_deadline_s
        for tid, (_, heard) in self.table.items():
            if now - heard > quiet:
                self.table.pop(tid)

    def clear(self) -> None:
        self.table.clear()

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self.table

    def items(self) -> list[tuple[str, tuple[Grant, float]]]:
        return list(self.table.items())


def early_grant_fits(layers: list[LayerSpec], grant: Grant) -> bool:
    """An early grant (decision 110) is used only if every layer it grants is the size granted."""
    sizes = [layers[i].num_bytes if 0 <= i < len(layers) else -1 for i in grant.layers]
    return sizes == grant.sizes


# ============================== Pulls in pieces

MISMATCH = FailReason.MISMATCH.value
NOT_BLOCKS = f"{MISMATCH}: only a transfer of blocks can be pulled in pieces"


@dataclasses.dataclass
class Split:
    """A held transfer's pieces (on the parent ``SendState``)."""

    pieces: int  # how many pulls it serves in all (from its first pull)
    children: set[str] = dataclasses.field(default_factory=set)  # started pieces' transfer ids
    done: set[str] = dataclasses.field(default_factory=set)
    num_bytes: int = 0
    busy_s: float = 0.0
    first_dispatch: float | None = None
    waiting: list[Pull] = dataclasses.field(default_factory=list)  # came before any layer

    @property
    def all_pulled(self) -> bool:
        return len(self.children) >= self.pieces


@dataclasses.dataclass
class Piece(SendState):
    """One piece of a held transfer: a send to the receiver that pulled it."""

    parent: str = ""  # the held transfer's id
    heads: range | None = None  # the KV heads of the held layers it carries


class SplitPulls:
    """The sender's piece pulls (see the module docstring)."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self.core = sender.core
        limits = self.core.config.limits
        # piece pulls before start_send: (held id, piece id) -> (pull, until); bounded per puller and in all
        self.early: PeerTable[tuple[str, str], tuple[Pull, float]] = PeerTable(
            limits.max_pending_per_peer, limits.max_pending_pulls, ControlLimit.PENDING_PER_PEER,
            ControlLimit.PENDING_PULLS,
        )  # fmt: skip

    # --- pulls -------------------------------------------------------------------------------------------

    def on_pull(self, msg: Pull) -> None:
        parent = self.sender.table.get(msg.held)
        if parent is None:
            self._unheld(msg)
            return
        refusal = self._refusal(parent, msg)
        if refusal is not None:
            self._refuse(msg, refusal)
            return
        if msg.pieces == 0:
            self._release(parent)
            return
        split = parent.split = parent.split or Split(msg.pieces)
        if msg.pieces != split.pieces:
            reason = f"{MISMATCH}: pulls disagree on the piece count ({split.pieces}, {msg.pieces})"
            self._refuse(msg, reason)
            self.sender.fail(parent.transfer_id, reason, notify=True)
            return
        if not parent.items:
            if len(split.waiting) + len(split.children) >= split.pieces:
                self._refuse(msg, "every piece was pulled already")  # (waiting: no more than it serves)
                return
            split.waiting.append(msg)  # the layout is known from the first layer handed over
            return
        self._start_child(parent, split, msg)

    def _refusal(self, parent: SendState, msg: Pull) -> str | None:
        if parent.endpoint is not None or isinstance(parent, Piece):
            return "already pulled by another peer"
        if parent.pull_by is not None and msg.src_endpoint not in parent.pull_by:
            self.core.stats.add("offers_refused")
            self.core.refusals.refused("wrong_peer", f"pull of {msg.held} from {msg.src_endpoint}")
            return "not this transfer's peer"
        if parent.with_trailer:
            return f"{MISMATCH}: a transfer with a trailer cannot be pulled in pieces"
        split = parent.split
        if split is not None and msg.pieces and split.all_pulled:
            return "every piece was pulled already"
        if split is not None and split.children and msg.pieces == 0:
            return f"{MISMATCH}: released after pieces were pulled"
        taken = msg.transfer_id in self.sender.table or self.core.tombstones.get(SIDE, msg.transfer_id)
        if msg.pieces and (taken or msg.transfer_id == msg.held):
            return "piece transfer id already in use"
        return None

    def _refuse(self, msg: Pull, reason: str) -> None:
        if msg.pieces:  # a release has no transfer on the puller's side
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)

    def _unheld(self, msg: Pull) -> None:
        ended = self.core.tombstones.get(SIDE, msg.held)
        if ended is not None:
            self._refuse(msg, ended if ended != "done" else "already pulled by another peer")
            return
        key = (msg.held, msg.transfer_id)
        limit = self.early.admit(key, msg.src_endpoint)
        if limit is not None:
            self.core.stats.limit_hit(limit)
            self._refuse(msg, f"too many pending pulls ({limit.value})")
            return
        # the pull overtook start_send: hold it until the puller's (clamped) deadline
        until = self.core.now() + self.core.peer_deadline(msg.deadline_s)
        self.early.put(key, msg.src_endpoint, (msg, until))

    def started(self, parent: SendState) -> None:
        """``start_send`` of a held transfer: serve the piece pulls that came before it."""
        if not len(self.early):
            return
        for key, (msg, _) in self.early.items():
            if key[0] == parent.transfer_id:
                self.early.pop(key)
                self.on_pull(msg)

    def _release(self, parent: SendState) -> None:
        """Nobody needs this held transfer: it ends as finished (its blocks can be freed)."""
        del self.sender.table[parent.transfer_id]
        self.core.events.sent(parent.transfer_id, None)
        self.core.stats.add("sends_completed")
        self.core.tombstones.add(SIDE, parent.transfer_id, "done")

    # --- children ----------------------------------------------------------------------------------------

    def _start_child(self, parent: SendState, split: Split, msg: Pull) -> None:
        first = next(iter(parent.items.values()))
        blocks = all(isinstance(i, HeldBlocks) for i in parent.items.values())
        if not isinstance(first, HeldBlocks) or not blocks:
            self._refuse(msg, NOT_BLOCKS)
            return
        layout = first.paged.layout
        heads = range(msg.heads[0], msg.heads[1]) if msg.heads else None
        layers = _narrowed(parent.layers, layout, heads)
        if layers is None:
            self._refuse(msg, f"{MISMATCH}: heads {msg.heads} not held ({layout.value})")
            return
        now = self.core.now()
        lease_s = min(self.core.peer_deadline(msg.deadline_s), parent.lease.lease_s)
        lease = Lease.start(now, lease_s, max(parent.lease.limit - now, 0.0))
        child = Piece(
            msg.transfer_id, lease, layers, False, msg.src_endpoint, parent=parent.transfer_id,
            heads=heads, last_progress=now,
        )  # fmt: skip
        split.children.add(child.transfer_id)
        self.sender.table[child.transfer_id] = child
        self.core.stats.add("sends_started")
        self._copy_layers(parent, child)
        self.sender.offer(child)

    def layer_added(self, parent: SendState) -> None:
        """A layer of a held transfer was handed over: its pieces get it too; pulls that waited for
        the first layer start now."""
        split = parent.split
        if split is None:
            return
        for child_id in list(split.children):
            child = self.sender.table.get(child_id)
            if child is not None:
                self._copy_layers(parent, child)
            if child_id in self.sender.table:  # (copying fails the held transfer if it cannot be split)
                self.sender.dispatch(self.sender.table[child_id])
        waiting, split.waiting = split.waiting, []
        for msg in waiting:
            if parent.transfer_id in self.sender.table:
                self._start_child(parent, split, msg)

    def _copy_layers(self, parent: SendState, child: SendState) -> None:
        assert isinstance(child, Piece)
        for index, item in parent.items.items():
            if index in child.items:
                continue
            if not isinstance(item, HeldBlocks):
                reason = NOT_BLOCKS
                self.sender.fail(parent.transfer_id, reason, notify=True)
                return
            child.items[index] = HeldBlocks(item.paged.heads(child.heads), item.block_ids, item.ready_event)
            child.last_progress = self.core.now()

    def piece_done(self, child: Piece, timing: TransferTiming | None) -> None:
        """A piece completed: count it (its held transfer reports once all its pieces are done)."""
        parent = self.sender.table.get(child.parent)
        split = parent.split if parent is not None else None
        if parent is not None and split is not None:
            self._count_piece(parent, split, child, timing)

    def _count_piece(
        self, parent: SendState, split: Split, child: Piece, timing: TransferTiming | None
    ) -> None:
        split.done.add(child.transfer_id)
        if timing is not None:
            split.num_bytes += timing.num_bytes
            split.busy_s += timing.busy_seconds or 0.0
        if child.first_dispatch is not None:
            split.first_dispatch = min(split.first_dispatch or child.first_dispatch, child.first_dispatch)
        if len(split.done) < split.pieces:
            return
        del self.sender.table[parent.transfer_id]
        total = None
        if split.first_dispatch is not None:
            total = TransferTiming(split.num_bytes, self.core.now() - split.first_dispatch, split.busy_s)
        self.core.events.sent(parent.transfer_id, total)
        self.core.stats.add("sends_completed")
        self.core.tombstones.add(SIDE, parent.transfer_id, "done")

    def failed(self, st: SendState, reason: str) -> None:
        """A send failed. A piece: the held transfer fails (its other pieces with it). A held
        transfer: every piece still in flight ends, its receiver told."""
        if isinstance(st, Piece):
            self.sender.fail(st.parent, f"{reason} (piece {st.transfer_id})", notify=False)
        if st.split is None:
            return
        for child_id in sorted(st.split.children - st.split.done):
            self.sender.fail(child_id, reason, notify=True)

    # --- time --------------------------------------------------------------------------------------------

    @staticmethod
    def keeps_lease(parent: SendState) -> bool:
        """A held transfer whose every piece was pulled no longer expires itself: its pieces'
        leases (renewed by their receivers) bound it."""
        return parent.split is not None and parent.split.all_pulled

    def expire(self, now: float) -> None:
        for key, (msg, until) in self.early.items():
            if until <= now:
                self.early.pop(key)
                self._refuse(msg, FailReason.UNKNOWN.value)


def _narrowed(layers: list[LayerSpec], layout: KVLayout, heads: range | None) -> list[LayerSpec] | None:
    """The held layers' payload restricted to ``heads`` (None when it has no such heads)."""
    if heads is None:
        return list(layers)
    dim = HEAD_DIM.get(layout)
    if dim is None:
        return None
    out = []
    for spec in layers:
        if len(spec.shape) <= dim or heads.stop > spec.shape[dim]:
            return None
        shape = list(spec.shape)
        shape[dim] = len(heads)
        out.append(LayerSpec(tuple(shape), spec.dtype))
    return out


# ============================== The send side


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
            early = self.early_grants.take(transfer_id)
            mine = early if early is not None and early.src_endpoint == endpoint else None
            self.offer(st, early_grant_used=mine is not None and early_grant_fits(st.layers, mine))
            if mine is not None:
                self.on_grant(mine)  # the receiver granted before this Offer: send at once
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

    # --- messages ----------------------------------------------------------------------------------------

    def offer(self, st: SendState, early_grant_used: bool = False) -> None:
        """Announce ``st`` to its receiver; ``early_grant_used``: its early grant fits and is used."""
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
            early_grant_used=early_grant_used,
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
        if msg.transfer_id not in self.table:
            return False  # not sent from here (a receiving agent's every Renew)
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
