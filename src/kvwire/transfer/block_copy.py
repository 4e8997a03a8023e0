"""Paged-KV gather/scatter: one index op (one kernel launch on a GPU) per layer.

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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kvwire.errors import ConfigError
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.types import ByteSpans, CheckedSpans

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
