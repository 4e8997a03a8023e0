"""Paged gather/scatter for a *group* of layers in one kernel launch (Triton), with a torch fallback.

:mod:`kvwire.transfer.memory` costs one launch per layer. For a transfer of 32 layers of 2 MiB each
the launches (and the Python around them) cost more than the copy itself, so this module gathers the
selected blocks of every layer of a group into one contiguous buffer with **one** launch, and
scatters such a buffer back into the blocks of a destination cache with one launch.

Buffer format: ``out[l]`` is exactly ``block_copy.gather_blocks(kv_layers[l], block_ids, layout)`` (so a
receiver can scatter per layer with :func:`kvwire.transfer.memory.scatter_blocks` too, and the bytes on
the wire do not depend on which path produced them).

Geometry: every layout is ``planes x num_blocks x chunk`` elements with ``chunk`` contiguous per block:
KV_FIRST ``[2, NB, BS, H, D]`` has 2 planes (K and V) of ``NB`` chunks of ``BS*H*D``; BLOCK_FIRST
``[NB, 2, BS, H, D]`` and MLA ``[NB, BS, dim]`` have one plane of ``NB`` chunks.

The Triton path needs CUDA tensors, every layer contiguous with the same shape/dtype, 16-byte aligned
bases and chunks a multiple of 16 bytes (true for every real KV cache); otherwise, or without Triton,
the torch path runs (one ``index_select``/``index_copy_`` per layer). Work is enqueued on the current
stream; nothing synchronizes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvwire.errors import ConfigError
from kvwire.transfer.memory import GATE_MAGIC as _GATE_MAGIC
from kvwire.transfer.memory import KVLayout, SendItem, gather_blocks, gathered_shape, scatter_blocks

_TILE_WORDS = 8192  # 32 KiB per program step: 16 words (four 16-byte loads in flight) per thread of 16 warps
_NUM_WARPS = 16
# Where a gather/scatter runs. An NCCL send/recv CTA (640 threads x 96 registers, ~100 KiB shared
# memory: 16 of them for a 2-GPU NVLink pair on H200) needs a whole SM to itself. A copy spread over
# every SM (as one program per 4 KiB tile was: 16k programs for 64 MiB) makes the next NCCL kernel
# (the next message's send behind a gather, the next receive beside a scatter) wait until the copy
# drains: 20-35 us per message boundary, measured with benchmarks/timeline.py (decision 065). So a
# launch is a bounded grid of fat programs, PROGRAMS_PER_SM per SM on all but FREE_SMS SMs (at most
# a quarter of the GPU's SMs, so a small GPU still copies on most of them), each striding over the
# tiles; the free SMs take NCCL's CTAs the moment they launch.
FREE_SMS = 32
PROGRAMS_PER_SM = 1


_hint = threading.local()


@contextlib.contextmanager
def copy_share(share: float | None) -> Iterator[None]:
    """Gathers and scatters launched by this thread inside the block run on at most ``share`` of the
    GPU's SMs (None: no limit). A data plane wraps the copies that have slack in it, e.g. the gather
    of a message that only leaves after two others: at full width such a copy saturates HBM in a
    burst and slows the NCCL kernel beside it (a message ran at 290 instead of 360 GB/s next to one),
    while half the SMs still finish it long before its message leaves (decision 066)."""
    if share is not None and not 0.0 < share <= 1.0:
        raise ConfigError("copy_share: share must be in (0, 1]")
    previous = getattr(_hint, "share", None)
    _hint.share = share
    try:
        yield
    finally:
        _hint.share = previous


def _grid(total: int, max_programs: int, sm_count: int) -> int:
    """Programs of one launch: ``total`` tiles, at most ``max_programs`` (0: no bound), and within the
    current :func:`copy_share`."""
    grid = min(total, max_programs) if max_programs else total
    share = getattr(_hint, "share", None)
    if share is not None and share < 1.0 and sm_count:  # 1.0: every SM, i.e. no limit
        grid = min(grid, max(1, int(sm_count * share)))
    return grid


def copy_grid(sm_count: int, programs_per_sm: int = PROGRAMS_PER_SM, free_sms: int = FREE_SMS) -> int:
    """Programs of one gather/scatter launch on a GPU of ``sm_count`` SMs (0: one per tile)."""
    free = min(free_sms, sm_count // 4)
    return programs_per_sm * max(1, sm_count - free)


@functools.lru_cache(maxsize=1)
def _triton() -> Any | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return _build_kernel(triton, tl)


def triton_available() -> bool:
    """True when the one-launch Triton kernels can be used (Triton importable)."""
    return _triton() is not None


def _build_kernel(triton: Any, tl: Any) -> Any:
    # Values that change from call to call are not specialized on: a new specialization means a
    # compile and a CUDA module load, and a module load synchronizes the context, which deadlocks when
    # an NCCL receive on this GPU waits for data that the loading thread has yet to ask for. The
    # geometry (chunk_w, plane_stride_w) is fixed per cache and stays specialized (16-byte vectors).
    @triton.jit(do_not_specialize=["first_layer", "num_ids", "num_rows", "total"])  # type: ignore[untyped-decorator,unused-ignore]
    def copy_blocks(  # type: ignore[no-untyped-def]
        base_ptr,  # int32 view of layer 0: every layer is addressed relative to it
        layer_offsets,  # int64 [L]: (layer_l.data_ptr() - layer_0.data_ptr()) / 4
        first_layer,  # buffer layer 0 is cache layer first_layer
        block_ids,  # int64 [n]
        buf_ptr,  # int32 [L * planes * n * chunk_w]
        num_ids,
        num_rows,  # planes * num_ids: buffer rows per layer
        total,  # work items: layers * num_rows * num_tiles
        plane_stride_w,  # words between K and V planes (0 when one plane)
        chunk_w,  # words per block per plane
        num_tiles,  # tiles per chunk
        gate_ptr,  # int32 [magic, real, armed, 0] (only read when GATED)
        GATHER: tl.constexpr,
        GATED: tl.constexpr,
        MAGIC: tl.constexpr,
        TILE: tl.constexpr,
    ):
        # A bounded grid of programs strides over the work items (tile, row, layer), tiles of one
        # block chunk first (neighbouring programs touch neighbouring bytes). Bounded so the copy
        # leaves SMs free: an NCCL kernel launched next to it gets its CTAs in at once.
        if GATED:  # a stream-ordered scatter writes only real, armed data (see types.DeviceConsumer)
            magic = tl.load(gate_ptr, volatile=True)
            real = tl.load(gate_ptr + 1, volatile=True)
            armed = tl.load(gate_ptr + 2, volatile=True)
            passes = (magic == MAGIC) & (real == 1) & (armed == 1)
        else:
            passes = True
        arange = tl.arange(0, TILE)
        for item in range(tl.program_id(0), total, tl.num_programs(0)):
            tile = item % num_tiles
            rest = item // num_tiles
            row = rest % num_rows  # plane * num_ids + i
            layer = rest // num_rows
            plane = row // num_ids
            i = row - plane * num_ids
            block = tl.load(block_ids + i).to(tl.int64)
            layer_off = tl.multiple_of(tl.load(layer_offsets + first_layer + layer), 4)
            paged = base_ptr + layer_off + plane.to(tl.int64) * plane_stride_w + block * chunk_w
            flat = buf_ptr + (layer.to(tl.int64) * num_rows + row) * chunk_w
            offs = tile * TILE + arange
            mask = (offs < chunk_w) & passes
            if GATHER:
                tl.store(flat + offs, tl.load(paged + offs, mask=mask), mask=mask)
            else:
                tl.store(paged + offs, tl.load(flat + offs, mask=mask), mask=mask)

    return copy_blocks


def _geometry(layer: torch.Tensor, layout: KVLayout) -> tuple[int, int, int]:
    """(planes, num_blocks, chunk elements) of one contiguous layer tensor."""
    gathered_shape(layer, 1, layout)  # validates rank and the 2 of K/V
    if layout is KVLayout.KV_FIRST:
        return 2, int(layer.shape[1]), math.prod(layer.shape[2:])
    return 1, int(layer.shape[0]), math.prod(layer.shape[1:])


def group_shape(kv_layers: Sequence[torch.Tensor], num_blocks: int, layout: KVLayout) -> tuple[int, ...]:
    """Shape of the buffer :func:`gather_layers` fills: ``[num_layers, *gathered layer shape]``."""
    return (len(kv_layers), *gathered_shape(kv_layers[0], num_blocks, layout))


def _layers_ok(kv_layers: Sequence[torch.Tensor], layout: KVLayout) -> bool:
    """The layers qualify for the one-launch kernel (checked once per :class:`PagedLayers`)."""
    if _triton() is None or not kv_layers:
        return False
    first = kv_layers[0]
    _, _, chunk = _geometry(first, layout)
    if first.device.type != "cuda" or (chunk * first.element_size()) % 16:
        return False
    return all(
        t.is_contiguous()
        and t.shape == first.shape
        and t.dtype == first.dtype
        and t.device == first.device
        and t.data_ptr() % 16 == 0
        for t in kv_layers
    )


class PagedLayers:
    """A fixed list of one layout's layer caches, validated once (with each layer's offset from layer
    0 already on the device), for repeated gathers/scatters of any range of consecutive layers at one
    launch each and a few microseconds of host time. Build it when the KV caches are registered."""

    def __init__(
        self,
        kv_layers: Sequence[torch.Tensor],
        layout: KVLayout,
        programs_per_sm: int = PROGRAMS_PER_SM,
        free_sms: int = FREE_SMS,
    ) -> None:
        if not kv_layers:
            raise ValueError("PagedLayers needs at least one layer")
        if programs_per_sm < 0:
            raise ConfigError("PagedLayers: programs_per_sm must be >= 0 (0: one program per tile)")
        if free_sms < 0:
            raise ConfigError("PagedLayers: free_sms must be >= 0")
        self.layers = list(kv_layers)
        self.layout = layout
        first = self.layers[0]
        # programs of one launch (0: unbounded); see FREE_SMS
        self.max_programs = 0
        self.sm_count = 0
        if first.is_cuda:
            self.sm_count = _sm_count(first.device)
            self.max_programs = copy_grid(self.sm_count, programs_per_sm, free_sms)
        self.planes, num_blocks, chunk = _geometry(first, layout)
        self.one_launch = _layers_ok(self.layers, layout)
        words_per_elem = first.element_size() / 4
        self._chunk_w = int(chunk * words_per_elem)
        self._plane_stride_w = int(num_blocks * chunk * words_per_elem) if self.planes == 2 else 0
        self._base = first.view(-1).view(torch.int32) if self.one_launch else first
        self._offsets = _layer_offsets(tuple(t.data_ptr() for t in self.layers), first.device)
        if self.one_launch:
            self._load_kernels()

    def _load_kernels(self) -> None:
        """Compile and load both kernel variants now, once per geometry: a first launch later, while
        an NCCL receive waits on this GPU, would load a CUDA module, which synchronizes the context
        (see ``_build_kernel``). Harmless to the caches: the gather reads one block, the scatter (every
        scatter runs the gated variant) sits behind a closed gate and writes nothing."""
        first = self.layers[0]
        _open_gate(first.device)  # made now: making it later synchronizes the caller's stream
        key = (first.device, first.dtype, self.planes, self._chunk_w, self._plane_stride_w)
        if key in _LOADED:
            return
        ids = torch.zeros(1, dtype=torch.int64, device=first.device)
        buf = torch.empty(self.shape(1, 0, 1), dtype=first.dtype, device=first.device)
        self.gather(ids, buf, 0, 1)
        self.scatter(ids, buf, 0, 1, gate=torch.zeros(4, dtype=torch.int32, device=first.device))
        _LOADED.add(key)

    def shape(self, num_blocks: int, start: int = 0, stop: int | None = None) -> tuple[int, ...]:
        """Shape of the buffer for layers ``[start, stop)``: ``[layers, *gathered layer shape]``."""
        stop = len(self.layers) if stop is None else stop
        return (stop - start, *gathered_shape(self.layers[0], num_blocks, self.layout))

    def gather(
        self, block_ids: torch.Tensor, out: torch.Tensor, start: int = 0, stop: int | None = None
    ) -> None:
        """Blocks ``block_ids`` of layers ``[start, stop)`` into ``out`` (contiguous, :meth:`shape`)."""
        self._run(block_ids, out, start, stop, gather=True)

    def scatter(
        self,
        block_ids: torch.Tensor,
        data: torch.Tensor,
        start: int = 0,
        stop: int | None = None,
        gate: torch.Tensor | None = None,
    ) -> None:
        """``data`` (as :meth:`gather` fills it) into blocks ``block_ids`` of layers ``[start, stop)``.

        ``gate`` (device int32 ``[magic, real, armed, 0]``, see
        :data:`kvwire.transfer.memory.DeviceConsumer`): the kernel writes nothing unless the gate passes
        when it runs. Needs the one-launch path
        (:attr:`one_launch`); raises :class:`~kvwire.errors.ConfigError` otherwise."""
        self._run(block_ids, data, start, stop, gather=False, gate=gate)

    def capture_key(
        self, block_ids: torch.Tensor, buf: torch.Tensor, start: int, stop: int, gather: bool = True
    ) -> tuple[object, ...] | None:
        """What one :meth:`gather` (or ungated :meth:`scatter`) of ``[start, stop)`` launches, by
        address and value, when that launch can be captured into a CUDA graph and replayed: the
        one-launch path with ``block_ids`` already int64 on the layers' device (no conversion copy)
        and ``buf`` as the launch wants it. None otherwise. See
        :class:`kvwire.transfer.memory.CapturableProducer`."""
        first = self.layers[0]
        ok = (
            self.one_launch
            and block_ids.dtype == torch.int64
            and block_ids.device == first.device
            and block_ids.is_contiguous()
            and buf.device == first.device
            and buf.dtype == first.dtype
            and buf.is_contiguous()
            and buf.data_ptr() % 16 == 0
            and tuple(buf.shape) == self.shape(int(block_ids.numel()), start, stop)
        )
        if not ok:
            return None
        return (
            "paged-copy",
            gather,
            self._base.data_ptr(),
            self._offsets.data_ptr(),
            self.planes,
            self._chunk_w,
            self._plane_stride_w,
            self.max_programs,  # (a copy_share around the launch follows from the message's position)
            block_ids.data_ptr(),
            int(block_ids.numel()),
            buf.data_ptr(),
            start,
            stop,
        )

    @property
    def gated_scatter(self) -> bool:
        """True when :meth:`scatter` accepts a ``gate`` (Triton, CUDA, qualifying layers)."""
        return self.one_launch

    def _run(
        self,
        block_ids: torch.Tensor,
        buf: torch.Tensor,
        start: int,
        stop: int | None,
        gather: bool,
        gate: torch.Tensor | None = None,
    ) -> None:
        stop = len(self.layers) if stop is None else stop
        first = self.layers[0]
        shape = self.shape(int(block_ids.numel()), start, stop)
        if tuple(buf.shape) != shape or buf.dtype != first.dtype:
            raise ValueError(
                f"paged group copy: buffer {tuple(buf.shape)} {buf.dtype} does not match {shape}"
            )
        if buf.device != first.device:
            if gather:
                raise ValueError("gather: out must be on the layers' device")
            buf = buf.to(first.device, non_blocking=True)
        if self.one_launch and buf.is_contiguous() and buf.data_ptr() % 16 == 0:
            _launch(self, block_ids, buf, start, stop, gather, gate)
        elif gate is not None:
            raise ConfigError("a gated scatter needs the one-launch Triton path (CUDA, aligned layers)")
        elif gather:
            for index in range(start, stop):
                gather_blocks(self.layers[index], block_ids, self.layout, out=buf[index - start])
        else:
            for index in range(start, stop):
                scatter_blocks(self.layers[index], block_ids, buf[index - start], self.layout)


def _launch(
    group: PagedLayers,
    block_ids: torch.Tensor,
    buf: torch.Tensor,
    start: int,
    stop: int,
    gather: bool,
    gate: torch.Tensor | None,
) -> None:
    kernel = _triton()
    assert kernel is not None
    ids = block_ids if block_ids.dtype == torch.int64 else block_ids.to(torch.int64)
    if ids.device != buf.device:
        ids = ids.to(buf.device, non_blocking=True)
    n = int(ids.numel())
    if n == 0 or stop <= start:
        return
    rows = group.planes * n
    tiles = triton_cdiv(group._chunk_w, _TILE_WORDS)
    total = rows * (stop - start) * tiles
    if not gather and gate is None:
        gate = _open_gate(buf.device)  # one scatter variant (the gated one) to compile and load
    kernel[(_grid(total, group.max_programs, group.sm_count),)](
        group._base,
        group._offsets,
        start,
        ids,
        buf.view(-1).view(torch.int32),
        n,
        rows,
        total,
        group._plane_stride_w,
        group._chunk_w,
        tiles,
        gate if gate is not None else ids,  # any pointer when not GATED (never read)
        GATHER=gather,
        GATED=gate is not None,
        MAGIC=_GATE_MAGIC,
        TILE=_TILE_WORDS,
        num_warps=_NUM_WARPS,
    )


_LOADED: set[tuple[object, ...]] = set()  # geometries whose kernels are compiled and loaded


@functools.lru_cache(maxsize=16)
def _open_gate(device: torch.device) -> torch.Tensor:
    """A gate that always passes (ungated scatters run the gated kernel through it). Made once per
    device and waited for, so a kernel on any stream reads it complete."""
    gate = torch.tensor([_GATE_MAGIC, 1, 1, 0], dtype=torch.int32, device=device)
    torch.cuda.current_stream(device).synchronize()
    return gate


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@functools.lru_cache(maxsize=256)
def _layer_offsets(pointers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Word offsets of each layer from layer 0, on ``device`` (cached: caches rarely move)."""
    host = torch.tensor([(p - pointers[0]) // 4 for p in pointers], dtype=torch.int64)
    return host.to(device) if device.type == "cuda" else host


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SlabGather:
    """A capturable device producer (:class:`~kvwire.transfer.memory.CapturableProducer`) for one
    transfer whose layer ``i`` is ``slab[i]``: it gathers a message's layers, blocks ``block_ids`` of
    ``paged``, into their rows of the slab with one launch on the plane's send stream. Keep
    ``block_ids`` (int64, on the device) and the slab at the same addresses from one transfer to the
    next (e.g. one slab and one id buffer per prompt-length bucket) and the NCCL plane replays a
    captured graph instead of launching each message from Python."""

    def __init__(self, paged: PagedLayers, block_ids: torch.Tensor, slab: torch.Tensor) -> None:
        self.paged = paged
        self.block_ids = block_ids
        self.slab = slab
        self._whole: tuple[object, ...] | None = None  # capture key of the whole slab
        self._checked = False

    def __call__(self, items: Sequence[SendItem]) -> None:
        start, stop = _layer_range(items)
        self.paged.gather(self.block_ids, self.slab[start:stop], start, stop)

    def capture_key(self, items: Sequence[SendItem]) -> tuple[object, ...] | None:
        start, stop = _layer_range(items)
        if not self._checked:  # once: every row range of a capturable slab is capturable
            self._whole = self.paged.capture_key(self.block_ids, self.slab, 0, len(self.paged.layers))
            self._checked = True
        if self._whole is None:
            return None
        return (self._whole, start, stop)  # rows [start, stop) lie at a fixed offset in the slab


def _layer_range(items: Sequence[SendItem]) -> tuple[int, int]:
    start, stop = items[0].layer_index, items[-1].layer_index + 1
    if stop - start != len(items):
        raise ValueError("SlabGather: a message's layers must be consecutive")
    return start, stop


def gather_layers(
    kv_layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer into one buffer ``[L, *gathered layer shape]`` (or ``out``,
    which must be contiguous with that shape and the layers' dtype). One launch on the Triton path.
    For repeated calls on the same caches, build a :class:`PagedLayers` once instead."""
    group = PagedLayers(kv_layers, layout)
    if out is None:
        first = kv_layers[0]
        out = torch.empty(group.shape(int(block_ids.numel())), dtype=first.dtype, device=first.device)
    group.gather(block_ids, out)
    return out


def scatter_layers(
    kv_layers: Sequence[torch.Tensor], block_ids: torch.Tensor, data: torch.Tensor, layout: KVLayout
) -> None:
    """Write ``data`` (as filled by :func:`gather_layers`) into blocks ``block_ids`` of every layer."""
    PagedLayers(kv_layers, layout).scatter(block_ids, data)
