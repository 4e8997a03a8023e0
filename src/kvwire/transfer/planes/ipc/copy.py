"""Paged -> paged copies of many layers at once between device memory of two processes (the
destination is a peer's allocation mapped by CUDA IPC): **one kernel launch per group of layers**
that share their block geometry, whatever the number of blocks.

A group is a tile table (``(src_offset, dst_offset, bytes)`` relative to a layer's base, each at most
``tile_bytes``; see :func:`kvwire.transfer.planes.ipc.runs.tile_runs`) and one ``(src_base,
dst_base)`` address pair per layer. Both go to the GPU as one small int64 table (offsets in 4-byte
words relative to an *anchor* tensor of this process, so any two device addresses of the process's
address space, local or mapped, are reachable from one pointer); the Triton kernel's programs
stride over (layer, tile) items, a bounded grid. With every offset a multiple of 16 bytes (KV blocks
always are) the kernel is told so and moves 16-byte vectors.

Without Triton, or for spans not 4-byte aligned, each run is one ``copy_`` (slow, correct). Work goes
on the current stream; nothing synchronizes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

WORD = 4


@dataclasses.dataclass(frozen=True)
class CopyTuning:
    """Launch shape of the copy kernel (the defaults were measured on one H200, 2026-12-02:
    docs/performance.md "CUDA IPC plane")."""

    tile_bytes: int = 32 * 1024
    max_programs: int = 1056  # 8 per SM of an H200
    num_warps: int = 8


@dataclasses.dataclass
class LayerGroup:
    """Layers that share one tile table: ``bases`` holds one (source, destination) device address
    pair per layer; ``tiles`` the layer-relative ``(src_offset, dst_offset, bytes)`` copies."""

    tiles: np.ndarray
    bases: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return int(self.tiles[:, 2].sum()) * len(self.bases)


@functools.cache
def _kernel() -> Any | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["num_tiles", "total"])  # type: ignore[untyped-decorator,unused-ignore]
    def copy_tiles(anchor, table, num_tiles, total, TILE: tl.constexpr, ALIGNED: tl.constexpr):  # type: ignore[no-untyped-def]
        arange = tl.arange(0, TILE)
        bases = table + num_tiles * 3
        for item in range(tl.program_id(0), total, tl.num_programs(0)):
            layer = item // num_tiles
            tile = item - layer * num_tiles
            src = tl.load(bases + layer * 2) + tl.load(table + tile * 3)
            dst = tl.load(bases + layer * 2 + 1) + tl.load(table + tile * 3 + 1)
            n = tl.load(table + tile * 3 + 2)
            if ALIGNED:
                src = tl.multiple_of(src, 4)
                dst = tl.multiple_of(dst, 4)
                n = tl.multiple_of(n, 4)
            mask = arange < n
            tl.store(anchor + dst + arange, tl.load(anchor + src + arange, mask=mask), mask=mask)

    return copy_tiles


def kernel_available() -> bool:
    return _kernel() is not None


def copy_groups(
    groups: Sequence[LayerGroup], anchor: torch.Tensor, tuning: CopyTuning = CopyTuning()
) -> None:
    """Enqueue every group's copies on the current stream (``anchor``: any int32 tensor on the device
    that runs the copies; 16-byte aligned, as the caching allocator's are)."""
    kernel = _kernel()
    base = anchor.data_ptr()
    for group in groups:
        if not group.bases or len(group.tiles) == 0:
            continue
        addresses = np.asarray(group.bases, dtype=np.int64) - base
        aligned4 = not (np.any(group.tiles % WORD) or np.any(addresses % WORD))
        if kernel is None or not aligned4:
            _copy_each(group, anchor.device)
            continue
        aligned16 = not (np.any(group.tiles % 16) or np.any(addresses % 16))
        words = np.concatenate((group.tiles.reshape(-1), addresses.reshape(-1))) // WORD
        table = torch.from_numpy(words).to(anchor.device, non_blocking=True)  # staged: host reusable
        num_tiles = len(group.tiles)
        total = num_tiles * len(group.bases)
        tile_words = 1 << max(int(group.tiles[:, 2].max()) // WORD - 1, 1).bit_length()
        grid = (min(total, tuning.max_programs),)
        kernel[grid](
            anchor, table, num_tiles, total, TILE=tile_words, ALIGNED=aligned16, num_warps=tuning.num_warps
        )


def _copy_each(group: LayerGroup, device: torch.device) -> None:
    """One ``copy_`` per tile (no Triton, or spans not 4-byte aligned)."""
    from kvwire.transfer.planes.ipc.cuda_ipc import wrap

    src_extent = int((group.tiles[:, 0] + group.tiles[:, 2]).max())
    dst_extent = int((group.tiles[:, 1] + group.tiles[:, 2]).max())
    for src_base, dst_base in group.bases:
        src, dst = wrap(src_base, src_extent, device), wrap(dst_base, dst_extent, device)
        for s, d, n in group.tiles.tolist():
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
