"""Tensor parallelism of the built-in engine: TP=2 (two processes, gloo all-reduce) gives the same
greedy tokens as TP=1 (fp32, CPU), on the tiny preset and on HF Llamas built here, with KV heads
split over the ranks and replicated (fewer KV heads than ranks)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import kvwire
from kvwire.errors import ConfigError
from support.hf_models import hf_greedy, save_tokenizer

PROMPTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog and then", "abc"]
PARAMS = kvwire.SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _generate(tp: int, model: str = "tiny", **kw: Any) -> tuple[list[list[int]], list[int]]:
    llm = kvwire.LLM(model, dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp, **kw)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        runner = llm.engine.runner
        pids = runner.leader.workers.pids if tp > 1 else []  # type: ignore[union-attr]
        if tp > 1:
            assert llm.engine.model.num_local_kv_heads == max(1, llm.engine.model.config.num_kv_heads // tp)
    finally:
        llm.close()
    return [o.token_ids for o in outs], pids


def test_tiny_tp2_equals_tp1_and_workers_stop() -> None:
    expected, _ = _generate(1)
    got, pids = _generate(2)
    assert got == expected
    assert len({tuple(t) for t in expected}) == len(expected)  # outputs depend on the prompt
    assert pids and not any(_alive(p) for p in pids)  # close() stopped the other rank


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["split", "replicated"])
def test_hf_llama_tp2_equals_transformers(tmp_path: Path, kv_heads: int) -> None:
    hf_tok = save_tokenizer(tmp_path)
    torch.manual_seed(20261201)
    config = transformers.LlamaConfig(
        vocab_size=len(hf_tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    prompt_ids = [hf_tok(p)["input_ids"] for p in PROMPTS]
    expected = [hf_greedy(model, ids, 12) for ids in prompt_ids]
    llm = kvwire.LLM(str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        outs = llm.generate([list(p) for p in prompt_ids], PARAMS)
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == expected


def test_unshardable_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="KV heads"):
        kvwire.LLM("tiny", tensor_parallel_size=3)
