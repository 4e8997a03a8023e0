"""Small GGUF files written here with the ``gguf`` package's writer, laid out the way llama.cpp's
converter lays out a Llama checkpoint (q/k rows permuted per head, GGML dimension order), for the
GGUF loader's unit tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the byte-level BPE alphabet), in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}  # fmt: skip
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def vocabulary() -> list[str]:
    tokens = [*SPECIALS, *byte_alphabet()]
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (pairs (i, i + D/2) become adjacent rows)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


@dataclasses.dataclass
class WrittenModel:
    path: Path
    weights: dict[str, np.ndarray]  # HF names, the values the loader must produce (after quantization)


def write_tiny_llama(
    path: Path,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    architecture: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    tied: bool = True,
    seed: int = 7,
) -> WrittenModel:
    """A 2-layer Llama with random weights: matrices in ``qtype``, norms in F32."""
    rng = np.random.default_rng(seed)
    tokens = vocabulary()
    writer = gguf.GGUFWriter(str(path), architecture)
    for add, value in [
        (writer.add_block_count, LAYERS), (writer.add_context_length, 256),
        (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
        (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
        (writer.add_rope_dimension_count, HEAD_DIM), (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_rope_freq_base, 10000.0), (writer.add_vocab_size, len(tokens)),
        (writer.add_tokenizer_model, tokenizer_model), (writer.add_tokenizer_pre, pre),
        (writer.add_token_list, tokens), (writer.add_token_merges, MERGES),
        (writer.add_token_types, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))),
        (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2), (writer.add_add_bos_token, False),
        (writer.add_chat_template, CHAT_TEMPLATE),
    ]:  # fmt: skip
        add(value)  # type: ignore[operator]
    weights: dict[str, np.ndarray] = {}

    def matrix(gguf_name: str, hf_name: str, shape: tuple[int, int], heads: int = 0) -> None:
        values = rng.normal(0.0, 0.3, size=shape).astype(np.float32)
        stored = llama_cpp_permute(values, heads) if heads else values
        data = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        # Quantization works row by row, so quantizing the unpermuted rows gives what the loader
        # must produce once it has undone the permutation.
        plain = gguf.quants.quantize(values, qtype)
        weights[hf_name] = gguf.quants.dequantize(plain, qtype).astype(np.float32).reshape(shape)

    def norm(gguf_name: str, hf_name: str) -> None:
        values = rng.uniform(0.5, 1.5, size=HIDDEN).astype(np.float32)
        writer.add_tensor(gguf_name, values)
        weights[hf_name] = values

    matrix("token_embd.weight", "embed_tokens.weight", (len(tokens), HIDDEN))
    for i in range(LAYERS):
        b, h = f"blk.{i}", f"layers.{i}"
        norm(f"{b}.attn_norm.weight", f"{h}.input_layernorm.weight")
        matrix(f"{b}.attn_q.weight", f"{h}.self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), HEADS)
        matrix(f"{b}.attn_k.weight", f"{h}.self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS)
        matrix(f"{b}.attn_v.weight", f"{h}.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        matrix(f"{b}.attn_output.weight", f"{h}.self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM))
        norm(f"{b}.ffn_norm.weight", f"{h}.post_attention_layernorm.weight")
        matrix(f"{b}.ffn_gate.weight", f"{h}.mlp.gate_proj.weight", (FFN, HIDDEN))
        matrix(f"{b}.ffn_up.weight", f"{h}.mlp.up_proj.weight", (FFN, HIDDEN))
        matrix(f"{b}.ffn_down.weight", f"{h}.mlp.down_proj.weight", (HIDDEN, FFN))
    norm("output_norm.weight", "norm.weight")
    if not tied:
        matrix("output.weight", "lm_head.weight", (len(tokens), HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return WrittenModel(path, weights)
