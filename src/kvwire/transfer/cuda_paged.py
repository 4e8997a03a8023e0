"""Paged gather/scatter for a *group* of layers in one kernel launch (Triton), with a torch fallback.

:mod:`kvwire.transfer.paged` costs one launch per layer. For a transfer of 32 layers of 2 MiB each
the launches (and the Python around them) cost more than the copy itself, so this module gathers the
selected blocks of every layer of a group into one contiguous buffer with **one** launch, and
scatters such a buffer back into the blocks of a destination cache with one launch.

Buffer format: ``out[l]`` is exactly ``paged.gather_blocks(kv_layers[l], block_ids, layout)`` (so a
receiver can scatter per layer with :func:`kvwire.transfer.paged.scatter_blocks` too, and the bytes on
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

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.transfer.paged import KVLayout, gather_blocks, gathered_shape, scatter_blocks

_TILE_WORDS = 1024  # 4 KiB per program: 8 x 16-byte vectors per thread with 4 warps


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
    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def copy_blocks(  # type: ignore[no-untyped-def]
        base_ptr,  # int32 view of layer 0: every layer is addressed relative to it
        layer_offsets,  # int64 [L]: (layer_l.data_ptr() - layer_0.data_ptr()) / 4
        block_ids,  # int64 [n]
        buf_ptr,  # int32 [L * planes * n * chunk_w]
        num_ids,
        plane_stride_w,  # words between K and V planes (0 when one plane)
        chunk_w,  # words per block per plane
        GATHER: tl.constexpr,
        TILE: tl.constexpr,
    ):
        row = tl.program_id(0)  # plane * num_ids + i
        layer = tl.program_id(1)
        tile = tl.program_id(2)
        plane = row // num_ids
        i = row - plane * num_ids
        block = tl.load(block_ids + i).to(tl.int64)
        layer_off = tl.multiple_of(tl.load(layer_offsets + layer), 4)
        paged = base_ptr + layer_off + plane.to(tl.int64) * plane_stride_w + block * chunk_w
        # buffer row of (layer, plane, i): layer * (planes * num_ids) + row; grid dim 0 = planes * num_ids
        flat = buf_ptr + (layer.to(tl.int64) * tl.num_programs(0) + row) * chunk_w
        offs = tile * TILE + tl.arange(0, TILE)
        mask = offs < chunk_w
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


def _triton_ok(kv_layers: Sequence[torch.Tensor], buf: torch.Tensor, layout: KVLayout) -> bool:
    if _triton() is None or not kv_layers:
        return False
    first = kv_layers[0]
    if first.device.type != "cuda" or buf.device != first.device or not buf.is_contiguous():
        return False
    _, _, chunk = _geometry(first, layout)
    if (chunk * first.element_size()) % 16 or buf.data_ptr() % 16:
        return False
    return all(
        t.is_contiguous()
        and t.shape == first.shape
        and t.dtype == first.dtype
        and t.device == first.device
        and t.data_ptr() % 16 == 0
        for t in kv_layers
    )


def _launch(
    kv_layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    buf: torch.Tensor,
    layout: KVLayout,
    gather: bool,
) -> None:
    kernel = _triton()
    assert kernel is not None
    first = kv_layers[0]
    planes, num_blocks, chunk = _geometry(first, layout)
    words_per_elem = first.element_size() / 4
    chunk_w = int(chunk * words_per_elem)
    plane_stride_w = int(num_blocks * chunk * words_per_elem) if planes == 2 else 0
    offsets = _layer_offsets(tuple(t.data_ptr() for t in kv_layers), first.device)
    ids = block_ids.to(device=first.device, dtype=torch.int64)
    n = int(ids.numel())
    if n == 0:
        return
    grid = (planes * n, len(kv_layers), triton_cdiv(chunk_w, _TILE_WORDS))
    kernel[grid](
        first.view(-1).view(torch.int32),
        offsets,
        ids,
        buf.view(-1).view(torch.int32),
        n,
        plane_stride_w,
        chunk_w,
        GATHER=gather,
        TILE=_TILE_WORDS,
        num_warps=4,
    )


@functools.lru_cache(maxsize=256)
def _layer_offsets(pointers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Word offsets of each layer from layer 0, on ``device`` (cached: caches rarely move)."""
    host = torch.tensor([(p - pointers[0]) // 4 for p in pointers], dtype=torch.int64)
    return host.to(device) if device.type == "cuda" else host


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gather_layers(
    kv_layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer into one buffer ``[L, *gathered layer shape]`` (or ``out``,
    which must be contiguous with that shape and the layers' dtype). One launch on the Triton path."""
    shape = group_shape(kv_layers, int(block_ids.numel()), layout)
    first = kv_layers[0]
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    elif tuple(out.shape) != shape or out.dtype != first.dtype or not out.is_contiguous():
        raise ValueError(f"gather_layers: out {tuple(out.shape)} {out.dtype} does not match {shape}")
    if _triton_ok(kv_layers, out, layout):
        _launch(kv_layers, block_ids, out, layout, gather=True)
    else:
        for index, layer in enumerate(kv_layers):
            gather_blocks(layer, block_ids, layout, out=out[index])
    return out


def scatter_layers(
    kv_layers: Sequence[torch.Tensor], block_ids: torch.Tensor, data: torch.Tensor, layout: KVLayout
) -> None:
    """Write ``data`` (as filled by :func:`gather_layers`) into blocks ``block_ids`` of every layer."""
    shape = group_shape(kv_layers, int(block_ids.numel()), layout)
    first = kv_layers[0]
    if tuple(data.shape) != shape or data.dtype != first.dtype:
        raise ValueError(f"scatter_layers: data {tuple(data.shape)} {data.dtype} does not match {shape}")
    if data.device != first.device:
        data = data.to(first.device, non_blocking=True)
    if _triton_ok(kv_layers, data, layout):
        _launch(kv_layers, block_ids, data, layout, gather=False)
    else:
        for index, layer in enumerate(kv_layers):
            scatter_blocks(layer, block_ids, data[index], layout)
