"""Paged attention (reference and SDPA paths) equals dense causal attention over the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvwire.engine.attention import AttentionMetadata, reference_attention, sdpa_attention, write_kv
from kvwire.engine.config import AttentionBackend


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [S, Hq, D], k/v: [S, Hkv, D]: plain causal attention over one whole sequence."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("backend", [AttentionBackend.REFERENCE, AttentionBackend.SDPA])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense(backend: AttentionBackend, block_size: int) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, num_blocks = 4, 2, 32, 64
    # (tokens already in the cache, tokens computed this step): decodes, a whole prompt, a chunk.
    seqs = [(9, 1), (30, 1), (0, 13), (17, 6), (0, 1)]
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim)
    free_blocks = torch.randperm(num_blocks).tolist()  # scattered, not contiguous
    qs, ks, vs, expected, tables, slots, query_start = [], [], [], [], [], [], [0]
    for cached, new in seqs:
        total = cached + new
        q = torch.randn(total, heads, dim)
        k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
        blocks = [free_blocks.pop() for _ in range(-(-total // block_size))]
        seq_slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(total)]
        )
        write_kv(kv_cache, k[:cached], v[:cached], seq_slots[:cached])  # earlier steps
        qs.append(q[cached:])
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots.append(seq_slots[cached:])
        expected.append(dense_attention(q, k, v)[cached:])
        tables.append(blocks)
        query_start.append(query_start[-1] + new)
    max_blocks = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
        seq_lens_t=torch.tensor([c + n for c, n in seqs]),
        query_start_loc=query_start,
        seq_lens=[c + n for c, n in seqs],
        num_decodes=2,
        block_size=block_size,
    )
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    if backend is AttentionBackend.REFERENCE:
        out = reference_attention(q, kv_cache, meta)
    else:
        out = sdpa_attention(q, k, v, kv_cache, meta)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
