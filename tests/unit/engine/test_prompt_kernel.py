"""The native prompt-attention kernel (decision 152) equals dense causal attention within float32
rounding, reads q/k/v where the fused qkv projection left them, computes a prompt's rows alike whatever
else shares the call, refuses bad input before computing anything, and its fallback (SDPA per prompt)
keeps working where it is not built."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvwire.engine import attention
from kvwire.engine.attention import AttentionMetadata, resolve_backend, sdpa_attention, write_kv
from kvwire.engine.attention import _prompts_native as native_prompts
from kvwire.engine.config import AttentionBackend


def test_the_native_prompt_kernel_is_built() -> None:
    """``pip install`` (scripts/setup.sh) builds it wherever a C compiler is found, CI's included."""
    assert attention.NATIVE_PROMPT, attention.NATIVE_PROMPT_ERROR


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [S, Hq, D], k/v: [S, Hkv, D], one sequence: causal attention in float64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v).float()


def _fused(tokens: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one fused [T, (Hq + 2 Hkv) * D] projection, the engine's layout."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    return q, k, qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    out = torch.full(q.shape, 7.0)
    starts = np.array([s for s, _ in rows], dtype=np.int64)
    native_prompts(out, q, k, v, starts, np.array([n for _, n in rows], dtype=np.int64))
    return out


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim"),
    [
        ([1, 15, 16, 17, 40], 9, 3, 64),  # SmolLM2's heads; lengths around a tile
        ([256, 33], 9, 3, 64),
        ([50, 7], 4, 4, 64),  # no grouping
        ([70], 8, 1, 64),  # one KV head for eight query heads
        ([31, 64], 4, 2, 128),
    ],
)
def test_prompt_kernel_matches_dense_attention(lens: list[int], heads: int, kv_heads: int, dim: int) -> None:
    lead = 3  # rows of other kinds before the prompts (decodes): left untouched
    q, k, v = _fused(lead + sum(lens), heads, kv_heads, dim, seed=len(lens) + dim)
    rows, start = [], lead
    for n in lens:
        rows.append((start, n))
        start += n
    out = _run(q, k, v, rows)
    assert torch.equal(out[:lead], torch.full((lead, heads, dim), 7.0))
    for s, n in rows:
        want = _dense(q[s : s + n], k[s : s + n], v[s : s + n])
        torch.testing.assert_close(out[s : s + n], want, atol=1e-5, rtol=1e-5)


def test_a_prompts_rows_do_not_depend_on_what_shares_the_call() -> None:
    """Bit for bit: alone, or after other prompts at another offset (P and D, the same engine on both
    sides, compute the same values)."""
    heads, kv_heads, dim = 9, 3, 64
    q, k, v = _fused(300, heads, kv_heads, dim, seed=3)
    together = _run(q, k, v, [(0, 37), (37, 200), (237, 63)])
    for start, n in [(0, 37), (37, 200), (237, 63)]:
        alone = _run(q[start : start + n], k[start : start + n], v[start : start + n], [(0, n)])
        assert torch.equal(alone, together[start : start + n])


def _kernel(**changes: object) -> None:
    q = _fused(20, 4, 2, 64, seed=0)[0]
    flat = torch.empty(0).set_(q.untyped_storage()).numpy()
    row = q.stride(0)
    args: dict[str, object] = {
        "out": torch.empty(20, 4, 64).numpy(), "q": flat, "q_off": 0, "q_row": row, "k": flat, "k_off": 256,
        "k_row": row, "v": flat, "v_off": 384, "v_row": row, "starts": np.array([0], dtype=np.int64),
        "lens": np.array([20], dtype=np.int64), "tokens": 20, "heads": 4, "kv_heads": 2, "dim": 64,
        "scale": 0.125,
    }  # fmt: skip
    args.update(changes)
    assert attention._prompt_native is not None
    attention._prompt_native.prompt(*args.values())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": 32}, "head size 32"),
        ({"kv_heads": 3}, "query heads over"),
        ({"lens": np.array([21], dtype=np.int64)}, "outside"),
        ({"starts": np.array([-1], dtype=np.int64)}, "outside"),
        ({"starts": np.array([0, 1], dtype=np.int64)}, "as many"),
        ({"v_off": 10_000}, "buffers disagree"),
        ({"q_row": 100}, "buffers disagree"),  # rows would overlap
        ({"tokens": 21}, "buffers disagree"),
        ({"out": np.empty(10, dtype=np.float32)}, "buffers disagree"),
    ],
)
def test_prompt_kernel_refuses_bad_input(changes: dict[str, object], message: str) -> None:
    _kernel()  # the unchanged arguments are fine
    with pytest.raises(ValueError, match=message):
        _kernel(**changes)


def _step(dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step of two decodes, two whole prompts and a chunk over earlier KV, SmolLM2's head counts."""
    heads, kv_heads, block_size, num_blocks = 9, 3, 16, 40
    seqs = [(20, 1), (5, 1), (0, 40), (24, 9), (0, 17)]  # (tokens in the cache, tokens this step)
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim)
    q, k, v = _fused(sum(n for _, n in seqs), heads, kv_heads, dim, seed=5)
    free, tables, slots, starts = torch.randperm(num_blocks, generator=gen).tolist(), [], [], [0]
    for cached, new in seqs:
        blocks = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        pos = torch.arange(cached + new)
        seq_slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        old = torch.randn(cached, kv_heads, dim, generator=gen)
        write_kv(kv_cache, old, old * 0.5, seq_slots[:cached])
        tables.append(blocks + [0] * (4 - len(blocks)))
        slots.append(seq_slots[cached:])
        starts.append(starts[-1] + new)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=torch.tensor(tables),
        seq_lens_t=torch.tensor([c + n for c, n in seqs]), query_start_loc=starts,
        seq_lens=[c + n for c, n in seqs], num_decodes=2, block_size=block_size,
    )  # fmt: skip
    write_kv(kv_cache, k, v, meta.slot_mapping)
    return q, k, v, kv_cache, meta


@pytest.mark.parametrize("dim", [64, 32])
def test_paged_step_takes_the_kernel_for_whole_prompts_and_agrees_with_sdpa(
    dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes, whole prompts and a chunk in one step: the paged backend (kernels) equals torch's
    SDPA path; head size 32 (not the kernel's) takes SDPA for its prompts."""
    q, k, v, kv_cache, meta = _step(dim)
    calls: list[int] = []
    real = attention._prompts_native
    monkeypatch.setattr(attention, "_prompts_native", lambda *a: calls.append(1) or real(*a))
    paged = sdpa_attention(q, k, v, kv_cache, meta, paged=True)
    torch.testing.assert_close(paged, sdpa_attention(q, k, v, kv_cache, meta), atol=1e-5, rtol=1e-5)
    assert calls == ([1] if dim == 64 else [])


def test_without_the_kernel_prompts_take_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, kv_cache, meta = _step(64)
    want = sdpa_attention(q, k, v, kv_cache, meta)
    monkeypatch.setattr(attention, "_prompt_native", None)
    assert not attention._prompt_fits(q, k, v)
    assert torch.equal(sdpa_attention(q, k, v, kv_cache, meta, paged=True)[2:], want[2:])


def test_the_paged_backend_warns_once_when_the_kernel_is_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(attention, "_prompt_native", None)
    monkeypatch.setattr(attention, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="kvwire.engine.attention"):
        for _ in range(2):
            resolve_backend(AttentionBackend.PAGED, torch.device("cpu"), torch.float32)
    assert [r.message.count("prompt attention runs torch SDPA") for r in caplog.records] == [1]
