"""Paged attention (reference, SDPA and native-decode paths) equals dense causal attention over the same
tokens."""

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


@pytest.mark.parametrize(
    "backend", [AttentionBackend.REFERENCE, AttentionBackend.SDPA, AttentionBackend.PAGED]
)
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
        out = sdpa_attention(q, k, v, kv_cache, meta, paged=backend is AttentionBackend.PAGED)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_decode_only_step_reuses_one_gather_buffer_across_layers() -> None:
    """A decode-only step (the batched path): every layer gathers into the step's one buffer, and
    each layer still attends over its own cache (equal to the reference), not a previous layer's."""
    torch.manual_seed(1)
    heads, kv_heads, dim, num_blocks, block_size, layers = 6, 2, 16, 40, 4, 3
    lens = [5, 11, 8]  # KV lengths after this step: different, so the padded slots are masked
    tables = [torch.randperm(num_blocks)[: -(-n // block_size)].tolist() for n in lens]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                                   for t, n in zip(tables, lens, strict=True)]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens_t=torch.tensor(lens),
        query_start_loc=list(range(len(lens) + 1)),
        seq_lens=lens,
        num_decodes=len(lens),
        block_size=block_size,
    )  # fmt: skip
    buffers = []
    for _ in range(layers):
        kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
        q = torch.randn(len(lens), heads, dim)
        k, v = torch.randn(len(lens), kv_heads, dim), torch.randn(len(lens), kv_heads, dim)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = sdpa_attention(q, k, v, kv_cache, meta)
        torch.testing.assert_close(out, reference_attention(q, kv_cache, meta), atol=1e-5, rtol=1e-5)
        buffers.append(meta.decode_kv_buffer(kv_cache))
    assert all(b is buffers[0] for b in buffers)
    bias = meta.decode_bias(torch.float32)
    assert torch.equal(bias == 0, meta.decode_mask) and bool(torch.isinf(bias[~meta.decode_mask]).all())
