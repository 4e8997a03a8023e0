"""The paged KV cache an engine hands its worker connector: allocated where transfers want it.

The engine asks here rather than building the tensors itself, so the engine never imports the
transfer package (``transfer`` <- ``connector`` <- ``engine``): on CPU the cache lives in shared
memory, where a peer on this host writes transferred KV straight into it (the shared-memory plane's
one-copy path, decision 080); on a GPU it is ordinary device memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.transfer.memory import shared_tensors


def allocate_kv_caches(
    shape: Sequence[int], num_layers: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """``num_layers`` zero-filled tensors of ``shape`` (e.g. ``[2, num_blocks, block_size,
    kv_heads, head_dim]``) on ``device``; on CPU all carved out of one shared-memory region."""
    if device.type == "cpu":
        return shared_tensors([tuple(shape)] * num_layers, dtype)
    return [torch.zeros(tuple(shape), device=device, dtype=dtype) for _ in range(num_layers)]
