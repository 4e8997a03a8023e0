"""Cut a loaded :class:`LlamaModel` down to one tensor-parallel rank's share (Megatron-style).

Attention: rank ``r`` keeps query heads ``[r*Hq/N, (r+1)*Hq/N)`` and the KV heads
``pieces.owned_heads(r, N, Hkv)`` (one replicated head when ``Hkv < N``), i.e. the rows of the fused
qkv projection (and its bias) for those heads, and the matching input columns of ``o_proj``.
MLP: the rows ``[r*I/N, (r+1)*I/N)`` of gate and of up, the same columns of ``down_proj``. The
outputs of ``o_proj`` and ``down_proj`` are partial sums, added over the ranks by ``all_reduce``.
Embeddings, norms and the LM head stay whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvwire.connector.pieces import check_tp, owned_heads
from kvwire.engine.models.config import ModelConfig
from kvwire.engine.models.llama import MLP, Attention, LlamaModel
from kvwire.errors import ConfigError


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ConfigError when the model cannot be split over ``size`` ranks."""
    check_tp(size, cfg.num_kv_heads)
    if cfg.num_heads % size:
        raise ConfigError(
            f"tensor-parallel size {size} must divide the model's {cfg.num_heads} attention heads"
        )
    if cfg.intermediate_size % size:
        raise ConfigError(
            f"tensor-parallel size {size} must divide the model's intermediate size {cfg.intermediate_size}"
        )


def shard_model(
    model: LlamaModel, rank: int, size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None
) -> None:
    """Keep rank ``rank``'s share of every layer's weights, in place."""
    cfg = model.config
    check_shardable(cfg, size)
    dim, q_per = cfg.head_dim, cfg.num_heads // size
    q_heads, kv_heads = range(rank * q_per, (rank + 1) * q_per), owned_heads(rank, size, cfg.num_kv_heads)
    q_size, kv_size = cfg.num_heads * dim, cfg.num_kv_heads * dim
    qkv_rows = torch.cat([
        torch.arange(q_heads.start * dim, q_heads.stop * dim),
        q_size + torch.arange(kv_heads.start * dim, kv_heads.stop * dim),
        q_size + kv_size + torch.arange(kv_heads.start * dim, kv_heads.stop * dim),
    ])  # fmt: skip
    inter = cfg.intermediate_size
    per = inter // size
    gate_up_rows = torch.cat(
        [torch.arange(rank * per, (rank + 1) * per), inter + torch.arange(rank * per, (rank + 1) * per)]
    )
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, MLP)
        _keep_rows(attn.qkv_proj, qkv_rows)
        _keep_cols(attn.o_proj, slice(q_heads.start * dim, q_heads.stop * dim))
        attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
        _keep_rows(mlp.gate_up_proj, gate_up_rows)
        _keep_cols(mlp.down_proj, slice(rank * per, (rank + 1) * per))
    model.tp_rank, model.tp_size = rank, size
    set_all_reduce(model, all_reduce)


def set_all_reduce(model: LlamaModel, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Bind the group's all-reduce to every row-parallel output (o_proj, down_proj)."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, MLP)
        attn.all_reduce = mlp.all_reduce = all_reduce


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    idx = rows.to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.data.index_select(0, idx).contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, idx).contiguous(), requires_grad=False)
    linear.out_features = int(rows.numel())


def _keep_cols(linear: nn.Linear, cols: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, cols].contiguous(), requires_grad=False)
    linear.in_features = int(linear.weight.shape[1])
