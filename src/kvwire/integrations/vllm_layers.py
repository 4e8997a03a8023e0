"""Worker-side view of vLLM's paged KV cache for the connector core (torch only, no vLLM import).

vLLM (>= 0.32) registers one tensor per attention layer, keyed by layer name
(``model.layers.3.self_attn.attn``), as a logical ``[num_blocks, num_kv_heads, block_size, C]`` view
(``C = 2 * head_size``: K and V share the last axis on the CPU backend; ``H == 1`` for MLA). The
physical order may differ (``KVCacheLayout``). kvwire moves whole blocks, so what matters is that
one block's bytes are one contiguous run. When the axis physically right inside the block axis is
the rank's KV heads (the CPU backend), each layer is presented to the core as
``[num_blocks, heads, rest, C]`` with the ``BLOCK_HEAD`` layout: the core can then cut head ranges,
which P and D of different tensor-parallel sizes need (decision 086). Otherwise it is a 3-d
``[num_blocks, rest, C]`` view with the ``MLA`` layout (block axis first, contents opaque: the same
TP size on both sides only). Gather/scatter of block ids is one ``index_select``/``index_copy_`` per
layer either way. P and D must run the same model, dtype and KV layout (checked on the wire: layer
shapes travel with every transfer).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from kvwire.errors import ConfigError
from kvwire.transfer.enums import KVLayout

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class KVLayers:
    """The KV-bearing layers in model order: ``names[i]`` is core layer ``i``, viewed as ``views[i]``."""

    names: tuple[str, ...]
    views: tuple[torch.Tensor, ...]  # sharing storage with vLLM's cache, in ``layout``
    layout: KVLayout = KVLayout.MLA  # BLOCK_HEAD [num_blocks, heads, rest, C] or MLA [num_blocks, rest, C]

    index: dict[str, int] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {name: i for i, name in enumerate(self.names)})

    def index_of(self, layer_name: str) -> int | None:
        """Core layer index of ``layer_name``; ``None`` for a layer that carries no own KV."""
        return self.index.get(layer_name)


def _layer_number(name: str) -> int:
    match = _LAYER_NUMBER.search(f".{name}.")
    if match is None:
        raise ConfigError(f"cannot find a layer number in KV cache layer name {name!r}")
    return int(match.group(1))


def _physical(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its axes in memory order (a contiguous view), the block axis first; a clear
    ConfigError when each block's bytes are not one contiguous run."""
    if tensor.dim() < 2:
        raise ConfigError(f"KV cache of {name} has shape {tuple(tensor.shape)}: expected a block axis first")
    order = sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True)
    physical = tensor.permute(order)
    if order[0] != 0 or not physical.is_contiguous():
        raise ConfigError(
            f"KV cache of {name} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) is not "
            "block-major in memory; kvwire needs each block's bytes contiguous (KVCacheLayout with the "
            "block axis outermost per layer, e.g. the default LBHNC)"
        )
    return physical


def block_view(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[num_blocks, rest, last]`` sharing its storage, when each block is one
    contiguous run of bytes (block axis outermost in memory); otherwise a clear ConfigError."""
    physical = _physical(name, tensor)
    return physical.reshape(tensor.shape[0], -1, physical.shape[-1])


def head_view(name: str, tensor: torch.Tensor, local_heads: int) -> torch.Tensor | None:
    """``tensor`` as ``[num_blocks, local_heads, rest, last]`` sharing its storage, when the axis
    physically right inside the block axis holds the rank's ``local_heads`` KV heads (always true for
    one head); None when the heads lie elsewhere. ConfigError as :func:`block_view`."""
    physical = _physical(name, tensor)
    if local_heads != 1 and (physical.dim() < 3 or physical.shape[1] != local_heads):
        return None
    return physical.reshape(tensor.shape[0], local_heads, -1, physical.shape[-1])


def kv_layers(kv_caches: Mapping[str, torch.Tensor], local_heads: int | None = None) -> KVLayers:
    """Order vLLM's registered caches by layer number and drop layers that share another layer's
    cache (cross-layer KV sharing: that KV is transferred once, with its owner). With
    ``local_heads`` (this rank's KV heads; None for MLA models) the layers are head views
    (``BLOCK_HEAD``) when every layer has its heads right inside the block, else opaque (``MLA``)."""
    seen: set[int] = set()
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for name in sorted(kv_caches, key=_layer_number):
        tensor = kv_caches[name]
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        names.append(name)
        tensors.append(tensor)
    if not names:
        raise ConfigError("vLLM registered no KV cache layers")
    if local_heads is not None:
        heads = [head_view(n, t, local_heads) for n, t in zip(names, tensors, strict=True)]
        if all(v is not None for v in heads):
            return KVLayers(tuple(names), tuple(v for v in heads if v is not None), KVLayout.BLOCK_HEAD)
    views = tuple(block_view(n, t) for n, t in zip(names, tensors, strict=True))
    return KVLayers(tuple(names), views, KVLayout.MLA)
