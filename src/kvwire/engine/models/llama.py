"""Llama / Qwen2 / Qwen3-family decoder in plain PyTorch.

One class covers the family: RMSNorm, RoPE (with Llama-3 frequency scaling), grouped-query attention
(optional qkv bias for Qwen2, q/k RMSNorm for Qwen3), SwiGLU MLP, tied or untied embeddings. q/k/v and
gate/up projections are fused into one matmul each (the loader concatenates HF's separate weights).
Tokens are packed: every tensor is ``[T, ...]`` over the step's new tokens of all sequences.

Inside the decoder, submodules are called through ``.forward``: ``nn.Module.__call__`` (its hook and
tracing checks) costs microseconds per call, and a decode step makes ~10 such calls per layer (no hooks
are registered on these modules; decision 135).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvwire.engine.attention import ForwardContext, attention
from kvwire.engine.models.config import ModelConfig, RopeScaling
from kvwire.engine.quant import RowSplit


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in fp32, cast back, then scale (the order HF uses). A float32 input skips the
        two casts, which would return their input (decision 154: two dispatches a norm)."""
        if x.dtype == torch.float32:
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32. Rotates the two halves of head_dim."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None):
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        if cfg.rope_scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, cfg.rope_scaling)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        self.cos_table: torch.Tensor
        self.sin_table: torch.Tensor
        self.register_buffer("cos_table", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin_table", freqs.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions: [T] -> (cos, sin) of full width, each [T, 1, D], computed once per forward for
        all layers: ``cos`` repeated for both halves, ``sin`` negated for the first (see apply_rope)."""
        cos = self.cos_table[positions][:, None, :].to(dtype)
        sin = self.sin_table[positions][:, None, :].to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x: [T, H, D] -> x with each (i, i + D/2) pair rotated by its position's angle:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (x2, x1)`` against the signed ``sin``
    (decision 154: four ops a layer instead of eight; ``a + b * -s`` is ``a - b * s`` exactly)."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1).mul_(sin).add_(x * cos)


def _scale_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    if s.rope_type == "linear":
        return inv_freq / s.factor
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, device: torch.device | None, dtype: torch.dtype):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias, device=device, dtype=dtype
        )
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False, device=device, dtype=dtype)
        norm = (lambda: RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype)) if cfg.qk_norm else None
        self.q_norm = norm() if norm else None
        self.k_norm = norm() if norm else None
        # Tensor parallelism (engine/tp/shard.py): sums o_proj's partial outputs over the ranks.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        num_qk, num_kv = self.num_heads + self.num_kv_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(x).view(-1, num_qk + num_kv, self.head_dim)  # [T, Hq + 2 * Hkv, D]
        qk, v = qkv.split((num_qk, num_kv), dim=1)  # [T, Hq + Hkv, D], [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            q, k = apply_rope(self.q_norm.forward(q), rope), apply_rope(self.k_norm.forward(k), rope)
        else:  # one rotation for q and k together (fewer kernel launches per layer)
            q, k = apply_rope(qk, rope).split((self.num_heads, self.num_kv_heads), dim=1)
        out = self.o_proj.forward(attention(self.layer_index, q, k, v, ctx).flatten(1))  # [T, hidden]
        return out if self.all_reduce is None else self.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | None, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = nn.Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, device=device, dtype=dtype
        )
        self.down_proj = nn.Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, device=device, dtype=dtype
        )
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        out = self.down_proj.forward(F.silu(gate) * up)
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, device: torch.device | None, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = Attention(cfg, layer_index, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, ctx)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaModel(nn.Module):
    """The decoder. ``forward`` returns hidden states; ``compute_logits`` applies the LM head."""

    def __init__(
        self, cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.config = cfg
        self.tp_rank, self.tp_size = 0, 1  # set by engine/tp/shard.py
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(cfg, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        )
        self.head: nn.Module | None = None  # a quantized LM head (engine/quantize.py) replaces both
        self.row_split: RowSplit | None = None  # quantized layers' decode/prompt rows (engine/quant.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm)."""
        x = self.embed_tokens(input_ids)
        rope = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer.forward(x, rope, ctx)
        return self.norm.forward(x)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank's cache holds (all of them without tensor parallelism)."""
        attn = self.layers[0].self_attn if len(self.layers) else None
        return attn.num_kv_heads if isinstance(attn, Attention) else self.config.num_kv_heads

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        if self.head is not None:
            return self.head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
