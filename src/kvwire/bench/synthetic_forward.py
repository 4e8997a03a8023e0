"""A synthetic Llama-3-8B-sized forward pass that writes each layer's K/V into paged caches and can hand
every layer over as soon as it is written: the compute side of the layer-wise overlap benchmarks
(NCCL and CUDA IPC planes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Llama-3-8B layer: hidden 4096, 32 query heads + 8 KV heads of 128, MLP 14336
HIDDEN, KV_DIM, MLP = 4096, 1024, 14336


class SyntheticForward:
    """Llama-3-8B-sized projections and MLP per layer (attention itself omitted) on ``tokens``."""

    def __init__(self, tokens: int, device: torch.device) -> None:
        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 0.02

        self.x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        self.w_qkv, self.w_o = w(HIDDEN, HIDDEN + 2 * KV_DIM), w(HIDDEN, HIDDEN)
        self.w_gu, self.w_d = w(HIDDEN, 2 * MLP), w(MLP, HIDDEN)

    def run(
        self,
        cache: list[torch.Tensor],
        ids: torch.Tensor,
        on_layer: Callable[[int, torch.cuda.Event], None] | None = None,
    ) -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x = self.x
        for index, layer in enumerate(cache):
            qkv = x @ self.w_qkv  # [T, 6144]
            q, k, v = qkv[:, :HIDDEN], qkv[:, HIDDEN : HIDDEN + KV_DIM], qkv[:, HIDDEN + KV_DIM :]
            blocks = (ids.numel(), *layer.shape[2:])  # [n, block_size, H, D]
            layer[0].index_copy_(0, ids, k.reshape(blocks))
            layer[1].index_copy_(0, ids, v.reshape(blocks))
            if on_layer is not None:
                written = torch.cuda.Event()
                written.record()
                on_layer(index, written)
            y = q @ self.w_o + x
            gate_up = y @ self.w_gu
            x = (F.silu(gate_up[:, :MLP]) * gate_up[:, MLP:]) @ self.w_d + y
        end.record()
        return start, end
