"""The native decode kernel (decision 148) equals torch's gather + SDPA and the per-sequence oracle
within float32 rounding, refuses bad input before computing anything, and its fallback (torch, with a
warning) keeps working where it is not built."""

from __future__ import annotations

import logging

import pytest
import torch

from kvwire.engine import attention
from kvwire.engine.attention import (
    AttentionMetadata,
    _decode_native,
    _decode_sdpa,
    reference_attention,
    resolve_backend,
    sdpa_attention,
)
from kvwire.engine.config import AttentionBackend
from support.engine_factories import greedy, make_engine, random_prompts, run_all


def test_the_native_decode_kernel_is_built() -> None:
    """``pip install`` (scripts/setup.sh) builds the C extension wherever a C compiler is found, CI's
    included; without it every CPU decode step would gather the KV blocks first."""
    assert attention.NATIVE_DECODE, attention.NATIVE_DECODE_ERROR
    assert attention.describe_decode() == "native"


def _decode_case(
    lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and a random cache; each sequence's blocks scattered over the cache (unused blocks
    hold other random values, which a wrong block id or length would read)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen) * 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lens:
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks + [0] * (width - len(blocks)))  # padded with block 0, as the runner does
    q = torch.randn(len(lens), heads, dim, generator=gen) * 2
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int64),
        seq_lens_t=torch.tensor(lens, dtype=torch.int64),
        query_start_loc=list(range(len(lens) + 1)),
        seq_lens=list(lens),
        num_decodes=len(lens),
        block_size=block_size,
    )
    return q, kv_cache, meta


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim", "block_size"),
    [
        ([250, 260, 271, 240, 255, 265, 245, 275], 9, 3, 64, 16),  # SmolLM2's shape at batch 8
        ([1], 9, 3, 64, 16),  # one token: the softmax of one score
        ([15, 16, 17, 32, 33], 9, 3, 64, 16),  # both sides of block boundaries
        ([16, 31, 64, 65], 4, 1, 128, 32),  # dim 128, a block of two 16-token tiles, 4 heads per KV head
        ([5, 100, 16, 48], 6, 2, 64, 4),  # blocks smaller than a tile
        ([3, 37, 80], 8, 8, 32, 16),  # no GQA; a head size off the vector path (the generic loop)
        ([47, 96, 2], 6, 3, 80, 48),  # a head size not a multiple of 16, blocks larger than its tile
        ([700, 5], 2, 1, 64, 16),  # a long sequence next to a short one
    ],
)
def test_native_decode_equals_gather_sdpa_and_the_oracle(
    lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    q, kv_cache, meta = _decode_case(lens, heads, kv_heads, dim, block_size)
    out = _decode_native(q, kv_cache, meta)
    torch.testing.assert_close(out, _decode_sdpa(q, kv_cache, meta), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, reference_attention(q, kv_cache, meta), atol=1e-5, rtol=1e-5)


def test_large_scores_do_not_overflow_the_softmax() -> None:
    """Scores in the hundreds (a running maximum that moves up tile after tile, far-apart scores
    that underflow to 0) give the same attention as torch's."""
    q, kv_cache, meta = _decode_case([90, 33], 4, 2, 64, 16, seed=3)
    kv_cache[0] *= torch.linspace(1, 30, kv_cache.shape[1])[:, None, None, None]
    q *= 8
    torch.testing.assert_close(
        _decode_native(q, kv_cache, meta), reference_attention(q, kv_cache, meta), atol=1e-5, rtol=1e-5
    )


def test_a_row_does_not_depend_on_its_batch() -> None:
    """P, D and a colocated engine batch a request with different others: its row must come out the
    same, bit for bit."""
    q, kv_cache, meta = _decode_case([40, 77, 129], 9, 3, 64, 16, seed=5)
    together = _decode_native(q, kv_cache, meta)
    for i in range(3):
        alone = AttentionMetadata(
            slot_mapping=meta.slot_mapping[i : i + 1],
            block_tables=meta.block_tables[i : i + 1],
            seq_lens_t=meta.seq_lens_t[i : i + 1],
            query_start_loc=[0, 1],
            seq_lens=meta.seq_lens[i : i + 1],
            num_decodes=1,
            block_size=16,
        )
        assert torch.equal(_decode_native(q[i : i + 1], kv_cache, alone), together[i : i + 1])


def _call(
    q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor,
    heads: int | None = None,
) -> None:  # fmt: skip
    assert attention._native is not None
    _, blocks, block_size, kv_heads, dim = kv.shape
    shape = (blocks, block_size, kv_heads, heads or q.shape[1], dim)
    attention._native.decode(out.numpy(), q.numpy(), kv.numpy(), tables.numpy(), lens.numpy(), *shape, 0.125)


@pytest.mark.parametrize(
    ("tables", "lens", "message"),
    [
        ([[0, 9]], [20], "block 9 outside the cache's 8"),
        ([[0, -1]], [20], "block -1 outside"),
        ([[0, 1]], [33], "length 33 outside 1..32"),
        ([[0, 1]], [0], "length 0 outside"),
    ],
)
def test_bad_block_tables_and_lengths_are_refused_before_anything_is_written(
    tables: list[list[int]], lens: list[int], message: str
) -> None:
    q, kv = torch.randn(1, 4, 64), torch.randn(2, 8, 16, 2, 64)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match=message):
        _call(q, kv, torch.tensor(tables), torch.tensor(lens), out)
    assert bool((out == 7.0).all())


def test_buffers_that_disagree_with_the_shape_are_refused() -> None:
    q, kv = torch.randn(2, 4, 64), torch.randn(2, 8, 16, 2, 64)
    tables, lens = torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="buffer sizes disagree"):
        _call(q, kv, tables, lens, torch.empty(2, 4, 32))  # out smaller than q
    with pytest.raises(ValueError, match="buffer sizes disagree"):
        _call(q, kv[..., :32].contiguous(), tables, lens, torch.empty_like(q))  # another head size
    with pytest.raises(ValueError, match="buffer sizes disagree"):
        _call(q, kv, tables[:, :1].contiguous()[:1], lens, torch.empty_like(q))  # a table short of a row
    with pytest.raises(ValueError, match="4 query heads over 3 KV heads"):
        _call(q, torch.randn(2, 8, 16, 3, 64), tables, lens, torch.empty_like(q))
    with pytest.raises(ValueError, match="not one int64"):
        _call(q, kv, tables, lens[:0], torch.empty_like(q))


def test_backend_choice() -> None:
    cpu, fp32 = torch.device("cpu"), torch.float32
    assert resolve_backend(AttentionBackend.AUTO, cpu, fp32) is AttentionBackend.PAGED
    assert resolve_backend(AttentionBackend.AUTO, cpu, torch.bfloat16) is AttentionBackend.SDPA
    assert resolve_backend(AttentionBackend.AUTO, torch.device("cuda"), fp32) is AttentionBackend.SDPA
    assert resolve_backend(AttentionBackend.SDPA, cpu, fp32) is AttentionBackend.SDPA
    assert make_engine().runner.backend is AttentionBackend.PAGED  # the CPU default


def test_a_bfloat16_cache_decodes_through_torch() -> None:
    q, kv_cache, meta = _decode_case([30, 18], 4, 2, 64, 16)
    kv16 = kv_cache.to(torch.bfloat16)
    k_new = v_new = torch.empty(2, 2, 64, dtype=torch.bfloat16)
    out = sdpa_attention(q.to(torch.bfloat16), k_new, v_new, kv16, meta, paged=True)
    torch.testing.assert_close(out, _decode_sdpa(q.to(torch.bfloat16), kv16, meta))


def test_without_the_kernel_the_paged_backend_falls_back_to_torch_and_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(attention, "_native", None)
    monkeypatch.setattr(attention, "_warned", set())
    cpu, fp32 = torch.device("cpu"), torch.float32
    with caplog.at_level(logging.WARNING, logger="kvwire.engine.attention"):
        assert resolve_backend(AttentionBackend.AUTO, cpu, fp32) is AttentionBackend.PAGED
        resolve_backend(AttentionBackend.PAGED, cpu, fp32)
    assert len([r for r in caplog.records if "native kernel is not built" in r.message]) == 1  # once
    q, kv_cache, meta = _decode_case([20, 45, 3], 9, 3, 64, 16)
    k_new = v_new = torch.empty(3, 3, 64)
    out = sdpa_attention(q, k_new, v_new, kv_cache, meta, paged=True)
    assert torch.equal(out, _decode_sdpa(q, kv_cache, meta))  # the torch path itself


@pytest.mark.parametrize("native", [True, False])
def test_an_engine_on_the_paged_backend_generates_what_sdpa_generates(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens of a batch of prompts (decodes batched, prefills alongside) on the default CPU
    backend, kernel built or not, equal the SDPA backend's."""
    if not native:
        monkeypatch.setattr(attention, "_native", None)
        monkeypatch.setattr(attention, "_warned", {"decode"})
    prompts = random_prompts(6, 5, 40, seed=2)
    outputs = {}
    for backend in (AttentionBackend.SDPA, AttentionBackend.AUTO):
        engine = make_engine(attention_backend=backend, block_size=4)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(24))
        outputs[backend] = {rid: out.token_ids for rid, out in run_all(engine).items()}
    assert outputs[AttentionBackend.AUTO] == outputs[AttentionBackend.SDPA]
