"""The decode step's fewer ops (decision 154) compute what they replaced, bit for bit: RoPE as
``x * cos + rotate_half(x) * signed sin``, the float32 RMSNorm without its identity casts, the
native kernel's queries copied into one buffer a step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvwire.engine import attention
from kvwire.engine.attention import AttentionMetadata, _decode_native
from kvwire.engine.models.config import ModelConfig
from kvwire.engine.models.llama import RMSNorm, RotaryEmbedding, apply_rope


def _config() -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=96, intermediate_size=128, num_layers=1,
        num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
    )  # fmt: skip


def _half_split_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation as written before decision 154 (cos/sin of half width)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_rope_equals_the_half_split_rotation_bit_for_bit(tokens: int) -> None:
    cfg = _config()
    rope = RotaryEmbedding(cfg)
    positions = torch.randint(
        0, cfg.max_position_embeddings, (tokens,), generator=torch.Generator().manual_seed(1)
    )
    x = torch.randn(tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim) * 3
    cos, sin = rope.cos_table[positions][:, None, :], rope.sin_table[positions][:, None, :]
    full = rope(positions, torch.float32)
    assert full[0].shape == (tokens, 1, cfg.head_dim)
    got = apply_rope(x, full)
    assert torch.equal(got, _half_split_rope(x, cos, sin))
    # a strided view (q or k split off the fused projection) rotates the same
    q = x[:, : cfg.num_heads]
    assert torch.equal(apply_rope(q, full), _half_split_rope(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_cast_normalise_scale_order(dtype: torch.dtype) -> None:
    norm = RMSNorm(96, 1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = (torch.randn(8, 96) * 5).to(dtype)
    want = norm.weight * F.rms_norm(x.float(), (96,), eps=1e-5).to(dtype)
    got = norm(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.skipif(not attention.NATIVE_DECODE, reason=attention.NATIVE_DECODE_ERROR or "kernel built")
def test_layers_sharing_a_steps_query_buffer_keep_their_own_outputs() -> None:
    """Two layers' decodes through one step's metadata (the query buffer reused) each equal the
    same decode through fresh metadata, and the first layer's output is not overwritten."""
    gen = torch.Generator().manual_seed(2)
    lens, block_size, kv_heads, heads, dim = [5, 33, 17], 16, 2, 6, 16
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    caches = [torch.randn(2, 9, block_size, kv_heads, dim, generator=gen) for _ in range(2)]
    queries = [torch.randn(3, heads + kv_heads, dim, generator=gen)[:, :heads] for _ in range(2)]

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(3, dtype=torch.int64), block_tables=tables,
            seq_lens_t=torch.tensor(lens), query_start_loc=[0, 1, 2, 3], seq_lens=lens, num_decodes=3,
            block_size=block_size,
        )  # fmt: skip

    shared = meta()
    outs = [_decode_native(q, cache, shared) for q, cache in zip(queries, caches, strict=True)]
    for out, q, cache in zip(outs, queries, caches, strict=True):
        assert torch.equal(out, _decode_native(q.contiguous(), cache, meta()))
    assert not torch.equal(outs[0], outs[1])
