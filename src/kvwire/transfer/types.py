"""Value types shared by the transfer agent, its data planes and their callers."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch

from kvwire.errors import ConfigError

# torch dtype <-> wire name (bf16 has no numpy dtype: bytes travel as uint8 views anyway)
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dt for dt, name in DTYPE_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Shape and dtype of one layer's payload in a transfer (e.g. gathered blocks of one KV layer)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"LayerSpec: unsupported dtype {self.dtype}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ConfigError(f"LayerSpec: shape must be non-negative ints, got {self.shape}")

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> LayerSpec:
        return cls(tuple(int(d) for d in tensor.shape), tensor.dtype)


@dataclasses.dataclass(frozen=True)
class PullSlice:
    """Pull mode, one piece of a transfer the sender holds for several receivers (P and D of
    different tensor-parallel sizes): the KV ``heads`` of each layer (the sender's local head
    indices; None: whole layers) of the transfer held as ``held_id``. The sender serves ``pieces``
    such pulls in all and reports the held transfer finished once every one was acknowledged."""

    held_id: str
    heads: range | None
    pieces: int


@dataclasses.dataclass(frozen=True)
class TransferTiming:
    """How long a completed transfer's data took on this side. Sender: from its first layer handed
    to the data plane (granted and ready) to the last acknowledgement. Receiver: from its first layer
    landing to the last. ``num_bytes``: the layers' payload (what crossed the wire).

    With layer-wise sends the first layer leaves while P's forward still computes the others, so
    ``seconds`` spans part of the forward. ``busy_seconds`` (sender only) counts just the time the
    plane held at least one of the transfer's layers (handed over -> reported sent): the wire's
    share, what a link-speed comparison should use. ``done_unix_s`` (receiver): the wall clock when
    the last layer (and the trailer) had landed, so that P's wall-clock hand-over time can be set
    against it on one host."""

    num_bytes: int
    seconds: float
    busy_seconds: float | None = None
    done_unix_s: float | None = None

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def busy_gbps(self) -> float | None:
        if self.busy_seconds is None or self.busy_seconds <= 0:
            return None
        return self.num_bytes / self.busy_seconds / 1e9


@dataclasses.dataclass(frozen=True)
class TransferEvents:
    """What happened since the previous ``poll()``. Each transfer id appears exactly once, in one set."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # transfer id -> reason
    # completed transfers (either set above) -> their data timing on this side
    timings: dict[str, TransferTiming] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed)


# sink(layer_index, tensor): called on a transfer thread; tensor valid only during the call.
LayerSink = Callable[[int, torch.Tensor], None]

# Stream-ordered receive consumer (planes with ``supports_device_consumers``, i.e. NCCL):
# ``consumer(items, gate)`` is called once per NCCL message, when its receive is *posted*, with the
# message's items that name this consumer and a CUDA stream current that runs after those items'
# ``dest`` are filled. It enqueues work that reads ``dest`` (e.g. a scatter into paged KV blocks) and
# that work must write nothing unless the *gate* passes: ``gate`` is a device int32 tensor
# ``[magic, real, armed, 0]`` and the work may write only if ``magic == GATE_MAGIC``, ``real == 1`` and
# ``armed == 1`` (:meth:`kvwire.transfer.planes.common.group_kernels.PagedLayers.scatter` takes it).
# ``on_received`` is reported only after the enqueued work completed; once ``cancel`` of the transfer
# returned, nothing of it writes any more (the plane disarms the gates and waits for work that
# already started). The work of different messages may run concurrently (the NCCL plane alternates
# two streams): it must not rely on an earlier message's work having finished. The consumer runs
# under a plane lock: it must only enqueue GPU work, never call the agent or the plane.
DeviceConsumer = Callable[[Sequence["RecvItem"], torch.Tensor], None]
GATE_MAGIC = 0x4B565752  # "KVWR"

# Stream-ordered send producer (planes with ``supports_device_producers``, i.e. NCCL):
# ``producer(items)`` is called once per NCCL message, on the thread that launches the message, right
# before its send, with the message's items that name this producer and the plane's send stream
# current (already ordered after those items' ``ready_event``). It enqueues the work that fills the
# items' ``tensor`` (e.g. a one-launch gather of paged KV blocks, see
# :meth:`kvwire.transfer.planes.common.group_kernels.PagedLayers.gather`); the send follows it on the same
# stream. The caller thus hands a whole transfer over at once and the plane gathers message by message, each
# gather just ahead of its message on the wire, with no event or thread hand-off per message. A
# producer must only enqueue GPU work on the current stream (kernels already loaded: a first launch
# loads a CUDA module, which synchronizes the device) and never call the agent or the plane; if it
# raises, its transfer fails and the message goes out as dummy bytes.
DeviceProducer = Callable[[Sequence["SendItem"]], None]


@typing.runtime_checkable
class CapturableProducer(Protocol):
    """A :data:`DeviceProducer` whose work a plane may capture into a CUDA graph once and replay for
    later transfers of the same shape (the NCCL plane does, see :mod:`kvwire.transfer.planes.nccl.graphs`).

    ``capture_key(items)`` names, by address and value, everything the work it would enqueue for
    ``items`` reads or writes apart from the items' tensors (the plane adds those): equal keys must
    mean identical work. None: this call cannot be captured (the plane calls the producer instead).
    Its work must not allocate or copy from host memory (a capture would keep the host address)."""

    def __call__(self, items: Sequence[SendItem]) -> None: ...

    def capture_key(self, items: Sequence[SendItem]) -> Hashable | None: ...


@dataclasses.dataclass(frozen=True)
class PeerRef:
    """A peer agent as one data plane sees it. A new ``instance_id`` at the same endpoint is a new
    peer (the old process is gone): planes key connections/communicators by ``instance_id``."""

    endpoint: str  # the peer agent's ZMQ control endpoint ("tcp://host:port")
    instance_id: str  # the peer's epoch: random per process start
    data_address: str  # what the peer's plane advertised (DataPlane.address); plane-specific
    plane_info: bytes = b""  # opaque bytes the peer's plane attached to its last control message


class CheckedSpans(tuple[tuple[int, int], ...]):
    """Spans checked when they were built (offsets >= 0), carrying their total and furthest byte, so
    a ByteSpans over them is checked in O(1): ``paged.block_spans`` hands one of these to every layer
    of a request, where checking each layer's spans one by one cost a loop over all its blocks."""

    total: int
    end: int

    def __new__(cls, spans: tuple[tuple[int, int], ...]) -> CheckedSpans:
        if any(off < 0 or n < 0 for off, n in spans):
            raise ValueError("ByteSpans: a span has a negative offset or length")
        obj = super().__new__(cls, spans)
        obj.total = sum(n for _, n in spans)
        obj.end = max((off + n for off, n in spans), default=0)
        return obj


@dataclasses.dataclass(frozen=True)
class ByteSpans:
    """Byte ranges of one contiguous ``base`` tensor whose concatenation is one layer's payload,
    e.g. a request's blocks inside a paged KV cache (see ``kvwire.transfer.block_copy.block_spans``).
    Lets a plane gather/scatter with the kernel (``sendmsg``/``recvmsg_into`` iovecs): no copy."""

    base: torch.Tensor  # contiguous
    spans: tuple[tuple[int, int], ...]  # (byte offset, num_bytes) into base

    def __post_init__(self) -> None:
        if not self.base.is_contiguous():
            raise ValueError("ByteSpans.base must be contiguous")
        limit = self.base.numel() * self.base.element_size()
        if isinstance(self.spans, CheckedSpans):
            if self.spans.end > limit:
                raise ValueError("ByteSpans: a span lies outside the base tensor")
        elif any(off < 0 or n < 0 or off + n > limit for off, n in self.spans):
            raise ValueError("ByteSpans: a span lies outside the base tensor")

    @property
    def num_bytes(self) -> int:
        if isinstance(self.spans, CheckedSpans):
            return self.spans.total
        return sum(n for _, n in self.spans)

    def flat(self) -> torch.Tensor:
        """The base as a flat ``uint8`` view."""
        return self.base.reshape(-1).view(torch.uint8)

    def gather(self) -> torch.Tensor:
        """The payload as one new contiguous ``uint8`` tensor (a copy)."""
        flat = self.flat()
        return torch.cat([flat[off : off + n] for off, n in self.spans]) if self.spans else flat[:0].clone()

    def scatter(self, data: torch.Tensor) -> None:
        """Write ``data`` (any dtype, ``num_bytes`` bytes) into the spans (a copy)."""
        src = data.reshape(-1).view(torch.uint8)
        flat, pos = self.flat(), 0
        for off, n in self.spans:
            flat[off : off + n].copy_(src[pos : pos + n], non_blocking=True)
            pos += n


@dataclasses.dataclass(frozen=True)
class SendItem:
    """One layer to move to a peer. ``tensor`` is contiguous; the plane must not modify it.
    ``spans`` (only given to planes with ``supports_spans``): when set, the payload is those
    bytes and ``tensor`` is just their base."""

    transfer_id: str
    layer_index: int
    tensor: torch.Tensor
    ready_event: Any | None = None  # torch.cuda.Event recorded after the tensor was written
    spans: ByteSpans | None = None
    # Only for planes with ``supports_device_producers``: fills ``tensor`` just before it is sent (see
    # DeviceProducer); ``ready_event`` then marks when the producer's *inputs* are ready.
    on_device: DeviceProducer | None = None
    # Only for planes with ``supports_device_signals``: a
    # kvwire.transfer.planes.nccl.device_signal.DeviceSignal the plane's send stream waits on
    # before this item's work (hand the transfer over before its
    # data exists; the producer's stream fires the signal once the KV is written). One per transfer.
    ready_signal: Any | None = None


@dataclasses.dataclass(frozen=True)
class RecvItem:
    """One layer to receive from a peer into ``dest`` (flat ``uint8`` tensor of ``num_bytes``).
    ``dest`` lives on the agent's device (receive budget) or in host memory (spill pool)."""

    transfer_id: str
    layer_index: int
    num_bytes: int
    dest: torch.Tensor
    # Only for planes with ``supports_spans``: write the bytes straight into these spans (e.g. the
    # caller's paged KV blocks); ``dest`` is then an empty placeholder.
    dest_spans: ByteSpans | None = None
    # Only for planes with ``supports_device_consumers`` and a device ``dest``: see DeviceConsumer.
    on_device: DeviceConsumer | None = None
