"""One transfer on the send side: its layers as handed over, granted, dispatched and acknowledged;
and the side's queue of granted layers to the data plane (:class:`SendQueue`).

An ordered plane (NCCL) takes a receiver's layers in the order it granted them: they wait in that
order, per receiver epoch, and a layer not handed over yet holds the later ones back. Every method
runs with ``core.lock`` held.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from kvwire.errors import TransferError
from kvwire.transfer.core import Core, TransferState
from kvwire.transfer.planes.base import DataPlane
from kvwire.transfer.registered_caches import PagedKV
from kvwire.transfer.types import ByteSpans, LayerSpec, PeerRef, SendItem, TransferTiming

if TYPE_CHECKING:
    from kvwire.transfer.split_pull import Split


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
