"""What a transfer moves and where it lives: value types, paged KV blocks, the registered caches,
shared memory.

Read in order: the value types the agent, its planes and their callers share (layer specs, byte
spans, plane items, timings); block gather/scatter of one paged KV layer; the worker's registered
caches and the way each plane moves their blocks; CPU tensors in shared memory a peer can map.

Paged-KV blocks
---------------
Paged-KV gather/scatter: one index op (one kernel launch on a GPU) per layer.

Layouts of one layer's paged KV cache tensor:

* ``KV_FIRST``    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (kvwire engine, vLLM default)
* ``BLOCK_FIRST`` ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (FlashInfer-style)
* ``MLA``         ``[num_blocks, block_size, latent_dim]`` (DeepSeek MLA: one latent per token)
* ``BLOCK_HEAD``  ``[num_blocks, num_kv_heads, rest, C]`` (vLLM's CPU cache ``[B, H, block_size,
  2 * head_size]``: heads right inside each block, the rest of a head's bytes opaque)

``gather_blocks`` returns the selected blocks as one contiguous tensor (the layer payload a transfer
sends); ``scatter_blocks`` writes such a payload into the selected blocks of a destination cache
(whose block ids may differ from the source's; the number of blocks must match). Both work on CPU and
CUDA tensors of any dtype; on CUDA they are asynchronous on the current stream.

Registered caches
-----------------
A worker's registered paged KV caches, and the fastest way each data plane moves their blocks.

The connector registers its KV caches once (:meth:`kvwire.transfer.TransferAgent.register_kv_caches`)
and then hands the agent *block ids*, never gathered copies. The agent picks, per plane:

* a plane with ``supports_spans`` (TCP): the blocks' byte spans inside the cache — the socket reads
  from / writes into the blocks themselves, no gather or scatter copy (:meth:`PagedKV.spans`);
* a plane with device producers/consumers (NCCL): the plane gathers each message's layers from the
  cache into a per-transfer slab right before sending it (one launch per message,
  :class:`~kvwire.transfer.planes.common.group_kernels.SlabGather`), and the receiver's stream scatters each
  layer into its blocks behind the receive, gated so a cancelled receive never writes
  (:meth:`PagedKV.consumer`); no host synchronization per layer;
* otherwise: one gather copy per layer on the sender and one scatter on arrival (the sink path).

Geometry: P sends the whole prompt's blocks. D may hold a prefix already (``skip_blocks``) or load
fewer blocks; a :class:`BlockTarget` says which of the payload's blocks land where. Only a target
that takes the payload exactly (``skip_blocks == 0`` and as many blocks as P sent) can receive in
place; any other lands through the copy path (:meth:`PagedKV.write`), which narrows the payload.

Threads: built on the agent's caller thread; :meth:`write` and the consumers run on transfer threads
(they only read the registered tensors, which never change after registration).

Shared memory
-------------
CPU tensors in shared memory (memfd), so that a peer process on the same host can map them.

Why: the shared-memory data plane writes a sender's KV blocks straight into the receiver's blocks
when those blocks live in memory the sender can map (one copy per byte instead of two through the
staging ring; docs/decisions/080-shm-one-copy.md). The built-in engine allocates its CPU KV cache
here; anything else (vLLM's caches, receive and spill buffers) stays ordinary memory and moves
through the ring.

A :class:`SharedRegion` is one ``memfd`` (an anonymous file: no name in ``/dev/shm``, nothing to
leak on ``kill -9``) mapped into this process. Its descriptor stays open while any tensor views the
region so the plane can pass it to peers (``SCM_RIGHTS``); it closes with the last such tensor.
Tensors made here behave as any CPU tensor (pages are zero until first written, as with
``torch.zeros``, but touched lazily).

Thread-safe: the registry is guarded by a lock.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import fcntl
import functools
import itertools
import math
import os
import threading
import typing
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvwire.errors import ConfigError
from kvwire.transfer.enums import KVLayout

# ============================== Value types

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
    # the payload's size, computed once here (read per layer on the request path)
    num_bytes: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"LayerSpec: unsupported dtype {self.dtype}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ConfigError(f"LayerSpec: shape must be non-negative ints, got {self.shape}")
        object.__setattr__(self, "num_bytes", math.prod(self.shape) * self.dtype.itemsize)

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
    # the rates, computed once here: GB/s over ``seconds`` (0.0 when none passed), and over
    # ``busy_seconds`` (None without them)
    gbps: float = dataclasses.field(init=False, compare=False)
    busy_gbps: float | None = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        gbps = self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        busy = self.busy_seconds
        busy_gbps = None if busy is None or busy <= 0 else self.num_bytes / busy / 1e9
        object.__setattr__(self, "gbps", gbps)
        object.__setattr__(self, "busy_gbps", busy_gbps)


@dataclasses.dataclass(frozen=True)
class TransferEvents:
    """What happened since the previous ``poll()``. Each transfer id appears exactly once, in one set."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # transfer id -> reason
    # completed transfers (either set above) -> their data timing on this side
    timings: dict[str, TransferTiming] = dataclasses.field(default_factory=dict)
    # ``poll(trailers=True)``: transfers in finished_recving that came with a trailer -> its payload
    trailers: dict[str, bytes] = dataclasses.field(default_factory=dict)

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
    e.g. a request's blocks inside a paged KV cache (see ``kvwire.transfer.memory.block_spans``).
    Lets a plane gather/scatter with the kernel (``sendmsg``/``recvmsg_into`` iovecs): no copy."""

    base: torch.Tensor  # contiguous
    spans: tuple[tuple[int, int], ...]  # (byte offset, num_bytes) into base

    # the payload's size (the spans' total), computed once here
    num_bytes: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.base.is_contiguous():
            raise ValueError("ByteSpans.base must be contiguous")
        limit = self.base.numel() * self.base.element_size()
        if isinstance(self.spans, CheckedSpans):
            if self.spans.end > limit:
                raise ValueError("ByteSpans: a span lies outside the base tensor")
            total = self.spans.total
        elif any(off < 0 or n < 0 or off + n > limit for off, n in self.spans):
            raise ValueError("ByteSpans: a span lies outside the base tensor")
        else:
            total = sum(n for _, n in self.spans)
        object.__setattr__(self, "num_bytes", total)

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


# ============================== Paged-KV blocks

BLOCK_DIM = {KVLayout.KV_FIRST: 1, KVLayout.BLOCK_FIRST: 0, KVLayout.MLA: 0, KVLayout.BLOCK_HEAD: 0}
HEAD_DIM = {KVLayout.KV_FIRST: 3, KVLayout.BLOCK_FIRST: 3, KVLayout.BLOCK_HEAD: 1}  # MLA: no head dimension
_NDIM = {KVLayout.KV_FIRST: 5, KVLayout.BLOCK_FIRST: 5, KVLayout.MLA: 3, KVLayout.BLOCK_HEAD: 4}


def block_ids_tensor(ids: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Block ids as an int64 index tensor on ``device`` (build once per request, reuse per layer)."""
    host = torch.tensor(list(ids), dtype=torch.int64)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _check(kv_layer: torch.Tensor, layout: KVLayout) -> int:
    if kv_layer.dim() != _NDIM[layout]:
        shape = tuple(kv_layer.shape)
        raise ValueError(f"{layout.value} layout needs a {_NDIM[layout]}-d tensor, got {shape}")
    if layout is KVLayout.KV_FIRST and kv_layer.shape[0] != 2:
        raise ValueError(f"kv_first layout needs dim 0 == 2, got {tuple(kv_layer.shape)}")
    if layout is KVLayout.BLOCK_FIRST and kv_layer.shape[1] != 2:
        raise ValueError(f"block_first layout needs dim 1 == 2, got {tuple(kv_layer.shape)}")
    return BLOCK_DIM[layout]


def gathered_shape(kv_layer: torch.Tensor, num_blocks: int, layout: KVLayout) -> tuple[int, ...]:
    """Shape of ``gather_blocks(kv_layer, ids, layout)`` for ``len(ids) == num_blocks``."""
    dim = _check(kv_layer, layout)
    shape = list(kv_layer.shape)
    shape[dim] = num_blocks
    return tuple(shape)


def gather_blocks(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, layout: KVLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The blocks ``block_ids`` of one layer as a new contiguous tensor (or into ``out``).

    Shape: the layer's shape with the block dimension replaced by ``len(block_ids)``.
    """
    dim = _check(kv_layer, layout)
    ids = block_ids.to(kv_layer.device) if block_ids.device != kv_layer.device else block_ids
    if out is None:
        return torch.index_select(kv_layer, dim, ids)
    return torch.index_select(kv_layer, dim, ids, out=out)


def scatter_blocks(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor, layout: KVLayout
) -> None:
    """Write ``data`` (as returned by :func:`gather_blocks`) into blocks ``block_ids`` of ``kv_layer``.

    ``data`` may live on another device (e.g. a host spill buffer): it is copied over first.
    """
    dim = _check(kv_layer, layout)
    expected = gathered_shape(kv_layer, int(block_ids.numel()), layout)
    if tuple(data.shape) != expected or data.dtype != kv_layer.dtype:
        raise ValueError(
            f"scatter_blocks: data {tuple(data.shape)} {data.dtype} "
            f"does not match {expected} {kv_layer.dtype}"
        )
    if data.device != kv_layer.device:
        data = data.to(kv_layer.device, non_blocking=True)
    ids = block_ids.to(kv_layer.device) if block_ids.device != kv_layer.device else block_ids
    kv_layer.index_copy_(dim, ids, data)


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive block ids merged into (first, count) runs, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def block_spans(kv_layer: torch.Tensor, block_ids: Sequence[int], layout: KVLayout) -> ByteSpans:
    """The bytes of ``gather_blocks(kv_layer, ids, layout)`` as spans of the (contiguous) cache itself:
    a plane with ``supports_spans`` sends from / receives into the blocks with no gather/scatter copy.
    Consecutive block ids become one span. Every layer of one geometry asking for the same ids gets
    the *same* spans tuple (memoized): a request's layers cost one computation, and planes may key
    per-transfer tables on the tuple's identity."""
    _check(kv_layer, layout)
    if not kv_layer.is_contiguous():
        raise ValueError("block_spans needs a contiguous KV cache tensor")
    num_blocks = kv_layer.shape[BLOCK_DIM[layout]]
    layer_bytes = kv_layer.numel() * kv_layer.element_size()
    return ByteSpans(kv_layer, _span_table(layer_bytes, num_blocks, layout, tuple(block_ids)))


@functools.lru_cache(maxsize=256)
def _span_table(
    layer_bytes: int, num_blocks: int, layout: KVLayout, block_ids: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    if block_ids and not 0 <= min(block_ids) <= max(block_ids) < num_blocks:
        raise IndexError(f"block id out of range 0..{num_blocks - 1}")
    halves: tuple[int, ...]
    if layout is KVLayout.KV_FIRST:
        half = layer_bytes // 2  # K blocks, then V blocks
        block_bytes = half // max(num_blocks, 1)
        halves = (0, half)
    else:
        block_bytes = layer_bytes // max(num_blocks, 1)
        halves = (0,)
    runs = _runs(block_ids)
    return CheckedSpans(
        tuple((h + first * block_bytes, count * block_bytes) for h in halves for first, count in runs)
    )


def head_slice(tensor: torch.Tensor, heads: range | None, layout: KVLayout) -> torch.Tensor:
    """The view of a layer (or gathered layer) restricted to KV ``heads`` (the tensor itself for
    None): what one rank of a tensor-parallel peer owns. Not contiguous for a strict sub-range."""
    if heads is None:
        return tensor
    dim = HEAD_DIM.get(layout)
    if dim is None:
        raise ConfigError(f"{layout.value} layout has no head dimension to slice")
    return tensor.narrow(dim, heads.start, len(heads))


# ============================== Registered caches

_SLABS_PER_SHAPE = 4  # idle send slabs kept per shape (a serving instance reuses a few buckets)


@dataclasses.dataclass(frozen=True)
class BlockTarget:
    """Where an incoming transfer lands: ``block_ids`` of every registered layer, in token order.
    The payload's first ``skip_blocks`` blocks are already present (not written); payload blocks
    past ``skip_blocks + len(block_ids)`` are dropped."""

    block_ids: tuple[int, ...]
    skip_blocks: int = 0
    # Only these KV heads of each block (a tensor-parallel peer owns a head range); None: all.
    heads: range | None = None

    def __post_init__(self) -> None:
        if self.skip_blocks < 0:
            raise ValueError("BlockTarget.skip_blocks must be >= 0")


class PagedKV:
    """The registered caches (one tensor per KV-bearing layer, all in ``layout``)."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        if not layers:
            raise ConfigError("register_kv_caches needs at least one KV layer")
        self.layers = list(layers)
        self.layout = layout
        self.device = self.layers[0].device
        for layer in self.layers:
            gathered_shape(layer, 1, layout)  # validates the layout's rank
        self.contiguous = all(layer.is_contiguous() for layer in self.layers)
        self._group: object | None = None  # group_kernels.PagedLayers, built on first device use
        self._group_lock = threading.Lock()
        self._slabs: dict[tuple[tuple[int, ...], torch.dtype], collections.deque[torch.Tensor]] = {}
        self._slab_lock = threading.Lock()
        self._views: dict[tuple[int, int], PagedKV] = {}  # head range -> the caches restricted to it

    def heads(self, heads: range | None) -> PagedKV:
        """The caches restricted to KV ``heads`` (itself for None): views that are not contiguous,
        so transfers of a head range take the copy path. Built once per range."""
        if heads is None:
            return self
        key = (heads.start, heads.stop)
        with self._group_lock:
            view = self._views.get(key)
            if view is None:
                view = PagedKV([head_slice(layer, heads, self.layout) for layer in self.layers], self.layout)
                self._views[key] = view
            return view

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def num_blocks(self, layer_index: int) -> int:
        return int(self.layers[layer_index].shape[BLOCK_DIM[self.layout]])

    def spec(self, layer_index: int, num_blocks: int) -> LayerSpec:
        """The payload of ``num_blocks`` blocks of one layer (what the sender announces)."""
        layer = self.layers[layer_index]
        return LayerSpec(gathered_shape(layer, num_blocks, self.layout), layer.dtype)

    def block_bytes(self, layer_index: int) -> int:
        layer = self.layers[layer_index]
        return layer.numel() * layer.element_size() // max(self.num_blocks(layer_index), 1)

    # --- host paths -----------------------------------------------------------------------------

    def spans(self, layer_index: int, block_ids: Sequence[int]) -> ByteSpans:
        """The blocks' bytes in place (planes with ``supports_spans``; contiguous caches only)."""
        return block_spans(self.layers[layer_index], block_ids, self.layout)

    def gather(self, layer_index: int, block_ids: torch.Tensor) -> torch.Tensor:
        """One layer's blocks as a new contiguous payload (the copy path)."""
        return gather_blocks(self.layers[layer_index], block_ids, self.layout)

    def takes_exactly(self, target: BlockTarget, layer_index: int, num_bytes: int) -> bool:
        """True when a payload of ``num_bytes`` lands in ``target``'s blocks with nothing skipped or
        dropped (the in-place paths need that)."""
        if target.skip_blocks:
            return False
        return num_bytes == len(target.block_ids) * self.block_bytes(layer_index)

    def write(self, layer_index: int, target: BlockTarget, data: torch.Tensor) -> None:
        """Scatter an arrived payload (any device) into ``target``, skipping the blocks D already holds
        and dropping blocks past its own (the copy path; raises ValueError on a shape mismatch)."""
        layer = self.layers[layer_index]
        dim = BLOCK_DIM[self.layout]
        block_shape = list(gathered_shape(layer, 1, self.layout))
        if data.dtype != layer.dtype or data.numel() % max(math.prod(block_shape), 1):
            raise ValueError(f"payload {tuple(data.shape)} {data.dtype} does not fit {layer.dtype} blocks")
        if data.dim() != layer.dim():  # a flat buffer: shape it as whole blocks
            block_shape[dim] = data.numel() // math.prod(block_shape)
            data = data.view(block_shape)
        sent = int(data.shape[dim])
        end = min(sent, target.skip_blocks + len(target.block_ids))
        count = max(end - target.skip_blocks, 0)
        if count == 0:
            return
        ids = torch.tensor(target.block_ids[:count], dtype=torch.int64)
        scatter_blocks(layer, ids, data.narrow(dim, target.skip_blocks, count), self.layout)

    # --- device paths (GPU planes) --------------------------------------------------------------

    def group(self) -> object:
        """The layers as one :class:`~kvwire.transfer.planes.common.group_kernels.PagedLayers`
        (built once)."""
        with self._group_lock:
            if self._group is None:
                from kvwire.transfer.planes.common.group_kernels import PagedLayers

                self._group = PagedLayers(self.layers, self.layout)
            return self._group

    def take_slab(self, num_blocks: int, allocate: object) -> torch.Tensor:
        """A send slab ``[L, *payload shape]`` for a transfer of ``num_blocks`` blocks: an idle one of
        that shape (same address from one transfer to the next, so a plane can replay captured sends)
        or a new one from ``allocate(shape, dtype)``. Give it back with :meth:`give_slab`."""
        shape = (self.num_layers, *self.spec(0, num_blocks).shape)
        dtype = self.layers[0].dtype
        with self._slab_lock:
            idle = self._slabs.get((shape, dtype))
            if idle:
                return idle.popleft()
        assert callable(allocate)
        slab: torch.Tensor = allocate(shape, dtype)
        return slab

    def give_slab(self, slab: torch.Tensor) -> None:
        with self._slab_lock:
            idle = self._slabs.setdefault((tuple(slab.shape), slab.dtype), collections.deque())
            if len(idle) < _SLABS_PER_SHAPE:
                idle.append(slab)

    def uniform(self) -> bool:
        """Every layer has the same shape and dtype (a slab of back-to-back layers needs that)."""
        first = self.layers[0]
        return all(layer.shape == first.shape and layer.dtype == first.dtype for layer in self.layers)

    def consumer(self, target: BlockTarget) -> DeviceConsumer:
        """A device consumer that scatters each received layer (``item.dest``) into ``target``'s
        blocks on the plane's stream, gated (see :data:`~kvwire.transfer.memory.DeviceConsumer`).
        Only for targets that take the payload exactly."""
        group = self.group()
        ids = torch.tensor(target.block_ids, dtype=torch.int64)
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        host_gate = self.device.type != "cuda"

        def consume(items: Sequence[RecvItem], gate: torch.Tensor) -> None:
            if host_gate and not _gate_open(gate):  # a CPU plane: the gate is checked here
                return
            for item in items:
                index = item.layer_index
                spec = self.spec(index, len(target.block_ids))
                data = item.dest.view(spec.dtype).view(spec.shape)
                group.scatter(  # type: ignore[attr-defined]
                    ids, data.unsqueeze(0), index, index + 1, gate=None if host_gate else gate
                )

        return consume

    def device_paths(self) -> bool:
        """The device producer/consumer paths apply: uniform layers and, on a GPU, gated scatters."""
        if not self.uniform():
            return False
        if self.device.type != "cuda":
            return True
        return bool(self.group().gated_scatter)  # type: ignore[attr-defined]


def _gate_open(gate: torch.Tensor) -> bool:
    magic, real, armed = (int(v) for v in gate[:3].tolist())
    return magic == GATE_MAGIC and real == 1 and armed == 1


# ============================== Shared memory

MEMFD_NAME = "kvwire-kv"  # shows in /proc/<pid>/maps as "/memfd:kvwire-kv (deleted)"
_ALIGN = 4096  # each tensor of an arena starts on its own page


@dataclasses.dataclass(frozen=True)
class SharedRegion:
    """One memfd mapped into this process: ``address`` is the mapping's base, ``fd`` its descriptor
    (owned by the registry: do not close; duplicate it to keep it past the region's life)."""

    region_id: int
    fd: int
    size: int
    address: int


def sealed_memfd(name: str, num_bytes: int) -> int:
    """A new memfd of ``num_bytes`` whose size can never change (sealed: a process that maps it
    cannot be made to fault on pages cut away under it, SIGBUS). Caller owns the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, num_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_peer_memfd(fd: int, num_bytes: int) -> None:
    """Raises ValueError unless ``fd`` (received from a peer) holds ``num_bytes`` and is sealed
    against shrinking, so mapping and writing all of it is safe."""
    size = os.fstat(fd).st_size
    if size != num_bytes:
        raise ValueError(f"peer memory descriptor holds {size} bytes, announced {num_bytes}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError(f"peer memory descriptor is not a sealable memfd: {exc}") from exc
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError("peer memory descriptor is not sealed against shrinking")


class GcSafeLock:
    """A lock that garbage-collector finalizers also need. A finalizer runs when the collector frees
    an object, which any allocation may trigger, also while this very thread holds the lock: taking
    it again there would deadlock. :meth:`finalizer` runs its work under the lock at once, or, when
    its thread is inside :meth:`held` already, when that section ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._deferred: list[tuple[Callable[..., None], tuple[object, ...]]] = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._local.busy = True
            try:
                yield
            finally:
                self._local.busy = False
        while self._deferred:
            fn, args = self._deferred.pop()
            self.finalizer(fn, *args)

    def finalizer(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` with the lock held (now, or once this thread's section ends)."""
        if getattr(self._local, "busy", False):
            self._deferred.append((fn, args))
            return
        with self.held():
            fn(*args)


_lock = GcSafeLock()
_regions: dict[int, SharedRegion] = {}
_ids = itertools.count(1)


def _forget(region_id: int) -> None:
    region = _regions.pop(region_id, None)
    if region is not None:
        os.close(region.fd)


def _release(region_id: int) -> None:
    """Forget a region and close its descriptor (once: a region closed early is no longer listed)."""
    _lock.finalizer(_forget, region_id)


def _new_region(num_bytes: int) -> tuple[SharedRegion, npt.NDArray[np.uint8]]:
    """A new region and a ``uint8`` array over all of it. Tensors and arrays made from that array
    keep it alive; the region's descriptor closes when it goes. The mapping itself holds no
    descriptor (``torch.from_file`` closes its own), so a region costs one open file."""
    fd = sealed_memfd(MEMFD_NAME, num_bytes)
    try:
        base = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=num_bytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    array: npt.NDArray[np.uint8] = base.numpy()
    region = SharedRegion(next(_ids), fd, num_bytes, base.data_ptr())
    with _lock.held():
        _regions[region.region_id] = region
    weakref.finalize(array, _release, region.region_id)
    return region, array


def shared_tensors(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero-filled contiguous CPU tensors of ``shapes``, all carved out of one new memfd (one
    region, so a peer maps one descriptor for a whole KV cache)."""
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * item for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    if total == 0:
        return [torch.zeros(tuple(shape), dtype=dtype) for shape in shapes]
    _, array = _new_region(total)
    flat = torch.from_numpy(array)  # the tensors below keep ``array`` (and the region) alive
    return [
        flat[off : off + size].view(dtype).view(tuple(shape))
        for off, size, shape in zip(offsets, sizes, shapes, strict=True)
    ]


def shared_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """One zero-filled CPU tensor in a new shared region."""
    return shared_tensors([shape], dtype)[0]


def region_of(tensor: torch.Tensor) -> tuple[SharedRegion, int] | None:
    """The shared region holding all of ``tensor``'s bytes and the offset of its first byte in it;
    None for a tensor that is not (entirely) in one (e.g. ordinary CPU memory, GPU memory)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock.held():
        for region in _regions.values():
            if region.address <= start and end <= region.address + region.size:
                return region, start - region.address
    return None


def live_regions() -> list[SharedRegion]:
    """Every region alive in this process (tests and diagnostics)."""
    with _lock.held():
        return list(_regions.values())


class SharedArena:
    """One shared region that hands out flat ``uint8`` buffers (first fit over a free list that
    merges neighbours; page-aligned). A buffer's range returns to the arena when the last tensor
    viewing it is gone. Pages are touched lazily: an arena costs memory only where it was used.
    Thread-safe."""

    def __init__(self, num_bytes: int) -> None:
        self.size = -(-num_bytes // _ALIGN) * _ALIGN
        self.region, self._array = _new_region(self.size)
        self._lock = GcSafeLock()
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, bytes), sorted by offset

    def allocate(self, num_bytes: int) -> torch.Tensor | None:
        """A buffer of ``num_bytes`` in the arena, or None when no free range is large enough."""
        size = max(_ALIGN, -(-num_bytes // _ALIGN) * _ALIGN)
        with self._lock.held():
            for i, (off, n) in enumerate(self._free):
                if n >= size:
                    if n == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, n - size)
                    break
            else:
                return None
        view = self._array[off : off + num_bytes]
        weakref.finalize(view, self._lock.finalizer, self._free_range, off, size)  # from_numpy holds it
        return torch.from_numpy(view)

    def _free_range(self, offset: int, size: int) -> None:
        """Return a buffer's range to the free list (the lock held)."""
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:  # merge right
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge left
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free.pop(i)[1])

    def close(self) -> None:
        """No more exports (the owner closes): the region's descriptor closes now; buffers still
        held keep their memory until they go."""
        _release(self.region.region_id)

    def free_bytes(self) -> int:
        with self._lock.held():
            return sum(n for _, n in self._free)
