"""Paged -> paged copies of byte runs between two device buffers (the destination may be a peer's
memory mapped by CUDA IPC): one Triton launch for all runs of a layer, or one ``copy_`` per run.

The kernel copies 4-byte words: it runs when every run's offsets and length are multiples of 4
(KV blocks always are) and Triton is available; programs stride over (run, tile) items, a bounded
grid, tiles masked by each run's length. Work goes on the current stream; nothing synchronizes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.transfer.planes.ipc.runs import Run

_TILE = 4096  # words per tile (16 KiB)
_MAX_PROGRAMS = 1024
_FEW_RUNS = 4  # this many runs or fewer: plain copy_ (no index upload, no launch of our own)


@functools.cache
def _kernel() -> Any | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["num_runs", "total", "tiles_per_run"])  # type: ignore[untyped-decorator,unused-ignore]
    def copy_runs(src_ptr, dst_ptr, runs_ptr, num_runs, total, tiles_per_run, TILE: tl.constexpr):  # type: ignore[no-untyped-def]
        arange = tl.arange(0, TILE)
        for item in range(tl.program_id(0), total, tl.num_programs(0)):
            run = item // tiles_per_run
            tile = item - run * tiles_per_run
            src_off = tl.load(runs_ptr + run * 3)
            dst_off = tl.load(runs_ptr + run * 3 + 1)
            length = tl.load(runs_ptr + run * 3 + 2)
            offs = tile.to(tl.int64) * TILE + arange
            mask = offs < length
            tl.store(dst_ptr + dst_off + offs, tl.load(src_ptr + src_off + offs, mask=mask), mask=mask)

    return copy_runs


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[Run]) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every ``(s, d, n)`` of ``runs`` (flat ``uint8`` device tensors)."""
    if not runs:
        return
    kernel = _kernel()
    aligned = all(s % 4 == 0 and d % 4 == 0 and n % 4 == 0 for s, d, n in runs)
    aligned = aligned and all(t.data_ptr() % 4 == 0 and t.numel() % 4 == 0 for t in (src, dst))
    if kernel is None or not aligned or len(runs) <= _FEW_RUNS:
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        return
    words = torch.tensor([v // 4 for run in runs for v in run], dtype=torch.int64).pin_memory()
    runs_dev = words.to(src.device, non_blocking=True)
    longest = max(n for _, _, n in runs) // 4
    tiles_per_run = -(-longest // _TILE)
    total = len(runs) * tiles_per_run
    grid = (min(total, _MAX_PROGRAMS),)
    kernel[grid](
        src.view(torch.int32), dst.view(torch.int32), runs_dev, len(runs), total, tiles_per_run, TILE=_TILE
    )
