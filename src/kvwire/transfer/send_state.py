"""One transfer on the send side: its layers as handed over, granted, dispatched and acknowledged."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvwire.errors import TransferError
from kvwire.transfer.lifecycle import TransferState
from kvwire.transfer.planes.base import DataPlane
from kvwire.transfer.registered_caches import PagedKV
from kvwire.transfer.types import ByteSpans, LayerSpec, PeerRef, SendItem

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
