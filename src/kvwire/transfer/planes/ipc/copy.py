"""Paged -> paged copies of many layers at once between device memory of two processes (the
destination is a peer's allocation mapped by CUDA IPC): **one kernel launch per group of layers**
that share their block geometry, whatever the number of blocks.

A group is a tile table (``(src_offset, dst_offset, bytes)`` relative to a layer's base, each at most
``tile_bytes``; see :func:`kvwire.transfer.planes.common.runs.tile_runs`), uploaded once per request,
and one ``(src_base, dst_base)`` address pair per layer, uploaded per launch. Offsets are 4-byte
words relative to an *anchor* tensor of this process, so any two device addresses of the process's
address space, local or mapped, are reachable from one pointer; the Triton kernel's programs
stride over (layer, tile) items, a bounded grid. With every offset a multiple of 16 bytes (KV blocks
always are) the kernel is told so and moves 16-byte vectors.

Without Triton, or for spans not 4-byte aligned, each run is one ``copy_`` (slow, correct). Work goes
on the current stream; nothing synchronizes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

WORD = 4
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CopyTuning:
    """Launch shape of the copy kernel (the defaults were measured on one H200, 2026-12-02:
    docs/performance.md "CUDA IPC plane")."""

    tile_bytes: int = 32 * 1024
    programs_per_sm: int = 32  # the grid's cap: this many programs per SM of the device
    num_warps: int = 8

    def max_programs(self, device: torch.device) -> int:
        return self.programs_per_sm * _sm_count(device.index or 0)


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@dataclasses.dataclass(frozen=True)
class TileTable:
    """One span-set pair's tiles, uploaded once: ``tiles`` (``(T, 3)`` bytes, host) and ``words`` (the
    same in 4-byte words, int64 on the device). A request's layers share one table."""

    tiles: np.ndarray
    words: torch.Tensor | None  # None: not 4-byte aligned (the copy_ fallback)
    aligned16: bool
    layer_bytes: int
    tile_words: int  # the kernel's TILE: the smallest power of two >= the longest tile

    @classmethod
    def build(cls, tiles: np.ndarray, device: torch.device) -> TileTable:
        """Upload ``tiles`` (on the current stream: it orders before any launch that reads them)."""
        aligned4 = not np.any(tiles % WORD)
        words = None
        if aligned4 and len(tiles):
            host = torch.from_numpy(np.ascontiguousarray(tiles.reshape(-1) // WORD)).pin_memory()
            words = host.to(device, non_blocking=True)
        longest = int(tiles[:, 2].max()) // WORD if len(tiles) else 1
        return cls(
            tiles,
            words,
            aligned4 and not np.any(tiles % 16),
            int(tiles[:, 2].sum()) if len(tiles) else 0,
            1 << max(longest - 1, 1).bit_length(),
        )


@dataclasses.dataclass
class LayerGroup:
    """Layers that share one tile table: ``bases`` holds one (source, destination) device address
    pair per layer."""

    table: TileTable
    bases: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return self.table.layer_bytes * len(self.bases)


@functools.cache
def _kernel() -> Any | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["num_tiles", "total"])  # type: ignore[untyped-decorator,unused-ignore]
    def copy_tiles(anchor, tiles, bases, num_tiles, total, TILE: tl.constexpr, ALIGNED: tl.constexpr):  # type: ignore[no-untyped-def]
        arange = tl.arange(0, TILE)
        for item in range(tl.program_id(0), total, tl.num_programs(0)):
            layer = item // num_tiles
            tile = item - layer * num_tiles
            src = tl.load(bases + layer * 2) + tl.load(tiles + tile * 3)
            dst = tl.load(bases + layer * 2 + 1) + tl.load(tiles + tile * 3 + 1)
            n = tl.load(tiles + tile * 3 + 2)
            if ALIGNED:
                src = tl.multiple_of(src, 4)
                dst = tl.multiple_of(dst, 4)
                n = tl.multiple_of(n, 4)
            mask = arange < n
            tl.store(anchor + dst + arange, tl.load(anchor + src + arange, mask=mask), mask=mask)

    return copy_tiles


def kernel_available() -> bool:
    return _kernel() is not None


@dataclasses.dataclass
class Launch:
    """One group made ready to launch: its bases already on their way to the device."""

    group: LayerGroup
    bases: torch.Tensor | None  # None: the copy_ fallback
    aligned16: bool


def prepare(groups: Sequence[LayerGroup], anchor: torch.Tensor) -> list[Launch]:
    """The host's share of :func:`copy_groups`: each group's base addresses uploaded (through pinned
    memory, on the current stream). ``anchor``: any int32 tensor on the device that runs the copies
    (16-byte aligned, as the caching allocator's are)."""
    kernel = _kernel()
    anchor_at = anchor.data_ptr()
    out = []
    for group in groups:
        table = group.table
        if not group.bases or table.layer_bytes == 0:
            continue
        offsets = [a - anchor_at for pair in group.bases for a in pair]
        if kernel is None or table.words is None or any(o % WORD for o in offsets):
            out.append(Launch(group, None, False))
            continue
        host = torch.tensor([o // WORD for o in offsets], dtype=torch.int64).pin_memory()
        out.append(Launch(group, host.to(anchor.device, non_blocking=True), table.aligned16))
        out[-1].aligned16 = table.aligned16 and not any(o % 16 for o in offsets)
    return out


def launch(launches: Sequence[Launch], anchor: torch.Tensor, tuning: CopyTuning = CopyTuning()) -> None:
    """Enqueue the prepared groups' copies on the current stream: one kernel launch each."""
    for item in launches:
        group, table = item.group, item.group.table
        if item.bases is None:
            _copy_each(group, anchor.device)
            continue
        num_tiles = len(table.tiles)
        total = num_tiles * len(group.bases)
        grid = (min(total, tuning.max_programs(anchor.device)),)
        args = (anchor, table.words, item.bases, num_tiles, total, table.tile_words, item.aligned16)
        _run(grid, args, tuning.num_warps)


def compiled(launches: Sequence[Launch], tuning: CopyTuning = CopyTuning()) -> bool:
    """Whether every launch goes through an already-compiled kernel (so launching loads nothing and
    never waits for the device: what may go behind :class:`~kvwire.transfer.planes.ipc.gate.LaunchGate`)."""
    return all(
        item.bases is not None
        and (item.group.table.tile_words, item.aligned16, tuning.num_warps) in _compiled
        for item in launches
    )


_compiled: dict[tuple[int, bool, int], Any] = {}
_direct = [True]  # False once launching a compiled kernel directly failed: Triton's own path then


def _run(grid: tuple[int], args: tuple[Any, ...], num_warps: int) -> None:
    """Launch through the compiled kernel's runner once it exists (less host time per launch than
    the JIT entry point, which re-binds and re-keys every call). The runner takes a 3-D grid and every
    argument of the kernel, constexprs included (Triton >= 3.3); pointers as integers, which the
    launcher takes as they are. A Triton whose runner differs falls back to the JIT path for good
    (the kernel stays compiled there, so launches still load nothing)."""
    key = (args[5], args[6], num_warps)
    compiled = _compiled.get(key)
    if compiled is not None and _direct[0]:
        try:
            compiled[(grid[0], 1, 1)](args[0].data_ptr(), args[1].data_ptr(), args[2].data_ptr(), *args[3:])
            return
        except Exception as exc:  # another Triton's runner signature: use the JIT path from now on
            _direct[0] = False
            logger.warning("IPC copy: Triton's compiled-kernel runner refused a launch (%s); JIT path", exc)
    kernel = _kernel()
    assert kernel is not None  # prepare() chose the copy_ fallback otherwise
    _compiled[key] = kernel[grid](*args[:5], TILE=args[5], ALIGNED=args[6], num_warps=num_warps)


def copy_groups(
    groups: Sequence[LayerGroup], anchor: torch.Tensor, tuning: CopyTuning = CopyTuning()
) -> None:
    """:func:`prepare` then :func:`launch`: every group's copies enqueued on the current stream."""
    launch(prepare(groups, anchor), anchor, tuning)


def _copy_each(group: LayerGroup, device: torch.device) -> None:
    """One ``copy_`` per tile (no Triton, or spans not 4-byte aligned)."""
    from kvwire.transfer.planes.ipc.cuda_ipc import wrap

    tiles = group.table.tiles
    src_extent = int((tiles[:, 0] + tiles[:, 2]).max())
    dst_extent = int((tiles[:, 1] + tiles[:, 2]).max())
    for src_base, dst_base in group.bases:
        src, dst = wrap(src_base, src_extent, device), wrap(dst_base, dst_extent, device)
        for s, d, n in tiles.tolist():
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
