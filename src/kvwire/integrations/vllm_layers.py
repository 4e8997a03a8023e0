"""Worker-side view of vLLM's paged KV cache for the connector core (torch only, no vLLM import).

vLLM (>= 0.32) registers one tensor per attention layer, keyed by layer name
(``model.layers.3.self_attn.attn``), as a logical ``[num_blocks, num_kv_heads, block_size, C]`` view
(``C = 2 * head_size``: K and V share the last axis on the CPU backend; ``H == 1`` for MLA). The
physical order may differ (``KVCacheLayout``). kvwire moves whole blocks, so what matters is that
one block's bytes are one contiguous run: then the layer is presented to the core as a 3-d
``[num_blocks, rest, C]`` view with the ``MLA`` layout (block axis first, contents opaque), and
gather/scatter of block ids is one ``index_select``/``index_copy_`` per layer. P and D must run the
same model, dtype and KV layout (checked on the wire: layer shapes travel with every transfer).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from kvwire.errors import ConfigError

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class KVLayers:
    """The KV-bearing layers in model order: ``names[i]`` is core layer ``i``, viewed as ``views[i]``."""

    names: tuple[str, ...]
    views: tuple[torch.Tensor, ...]  # [num_blocks, rest, C], sharing storage with vLLM's cache

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


def block_view(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[num_blocks, rest, last]`` sharing its storage, when each block is one
    contiguous run of bytes (block axis outermost in memory); otherwise a clear ConfigError."""
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
    return physical.reshape(tensor.shape[0], -1, physical.shape[-1])


def kv_layers(kv_caches: Mapping[str, torch.Tensor]) -> KVLayers:
    """Order vLLM's registered caches by layer number and drop layers that share another layer's
    cache (cross-layer KV sharing: that KV is transferred once, with its owner)."""
    seen: set[int] = set()
    names: list[str] = []
    views: list[torch.Tensor] = []
    for name in sorted(kv_caches, key=_layer_number):
        tensor = kv_caches[name]
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        names.append(name)
        views.append(block_view(name, tensor))
    if not names:
        raise ConfigError("vLLM registered no KV cache layers")
    return KVLayers(names=tuple(names), views=tuple(views))
