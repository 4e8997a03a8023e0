"""Built-in engine on CUDA (run on the GPU machine: ``pytest -m gpu tests/gpu/test_engine_gpu.py``)."""

from __future__ import annotations

import random

import pytest
import torch

from kvwire.engine import AttentionBackend, EngineConfig, LLMEngine, SamplingParams
from kvwire.engine.attention import AttentionMetadata, reference_attention, sdpa_attention, write_kv

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("CUDA is not available (run the gpu tests on the GPU machine)")


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    return [final[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("decode_graphs", [False, True])
def test_tiny_fp32_on_cuda_matches_cpu(decode_graphs: bool) -> None:
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(32, 127) for _ in range(n)] for n in (5, 40, 90, 17)]
    results = []
    for device in ("cpu", "cuda"):
        config = EngineConfig(model="tiny", device=device, dtype="float32", num_kv_blocks=128,
                              decode_graphs=decode_graphs and device == "cuda")  # fmt: skip
        results.append(_generate(LLMEngine(config), prompts, 16))
    assert results[0] == results[1]


@pytest.mark.parametrize(
    ("backend", "decode_graphs"),
    [(AttentionBackend.SDPA, False), (AttentionBackend.REFERENCE, False), (AttentionBackend.SDPA, True)],
)
def test_llama3_8b_random_bf16_prefills_and_decodes(backend: AttentionBackend, decode_graphs: bool) -> None:
    engine = LLMEngine(
        EngineConfig(model="llama3-8b-random", device="cuda", dtype="bfloat16", num_kv_blocks=512,
                     max_model_len=4096, attention_backend=backend, decode_graphs=decode_graphs)
    )  # fmt: skip
    rng = random.Random(1)
    prompts = [[rng.randrange(128_000) for _ in range(n)] for n in (2048, 7, 300)]
    outputs = _generate(engine, prompts, 8)
    assert [len(o) for o in outputs] == [8, 8, 8]
    assert all(0 <= t < 128256 for o in outputs for t in o)
    assert engine.stats().kv_blocks_in_use == 0
    engine.close()


def test_sdpa_paged_attention_matches_reference_in_bf16() -> None:
    torch.manual_seed(0)
    device, dtype, block_size = torch.device("cuda"), torch.bfloat16, 16
    kv_cache = torch.zeros(2, 64, block_size, 8, 128, device=device, dtype=dtype)
    seqs = [(100, 1), (37, 1), (0, 200), (64, 50)]  # (cached, new): two decodes, a prompt, a chunk
    blocks = torch.randperm(64).tolist()
    tables, slots, qs, ks, vs, starts = [], [], [], [], [], [0]
    for cached, new in seqs:
        total = cached + new
        table = [blocks.pop() for _ in range(-(-total // block_size))]
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(total)])
        k = torch.randn(total, 8, 128, device=device, dtype=dtype)
        v = torch.randn(total, 8, 128, device=device, dtype=dtype)
        write_kv(kv_cache, k[:cached], v[:cached], seq_slots[:cached].to(device))
        qs.append(torch.randn(new, 32, 128, device=device, dtype=dtype))
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots.append(seq_slots[cached:])
        tables.append(table)
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        seq_lens_t=torch.tensor([c + n for c, n in seqs], device=device),
        query_start_loc=starts, seq_lens=[c + n for c, n in seqs], num_decodes=2, block_size=block_size,
    )  # fmt: skip
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    expected = reference_attention(q, kv_cache, meta).float()
    torch.testing.assert_close(
        sdpa_attention(q, k, v, kv_cache, meta).float(), expected, atol=2e-2, rtol=2e-2
    )
