"""A Llama-architecture GGUF file as a :class:`ModelConfig` and weights for :class:`LlamaModel`.

GGUF names map onto the Hugging Face names (``blk.N.attn_q`` -> ``layers.N.self_attn.q_proj``), so
the copy reuses the HF loader's slicing into fused q/k/v and gate/up parameters. llama.cpp's
converter permutes the rows of q and k for Llama (it pairs RoPE dimensions as (2i, 2i+1); HF and
this engine rotate the halves (i, i + D/2)); :func:`unpermute_qk` undoes it.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch

from kvwire.engine.gguf_reader import GGUFFile, GGUFMetadata, GGUFTensor
from kvwire.engine.models.config import ModelConfig, RopeScaling
from kvwire.engine.models.llama import LlamaModel
from kvwire.engine.quant import Int4Groups, gguf_q4_groups
from kvwire.engine.weights import copy_hf_tensor, expected_names
from kvwire.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama",)
_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
        "output.weight": "lm_head.weight"}  # fmt: skip
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """Raises ModelLoadError for another architecture or a feature the engine lacks."""
    meta = gguf.metadata
    arch = str(meta.require("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path}: architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if int(meta.get(f"{arch}.expert_count") or 0) > 0:
        raise ModelLoadError(f"{gguf.path}: mixture-of-experts models are not supported")
    names = {t.name for t in gguf.tensors()}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{gguf.path}: per-dimension RoPE factors (rope_freqs) are not supported")
    heads, hidden = _int(meta, f"{arch}.attention.head_count"), _int(meta, f"{arch}.embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type="llama",
        vocab_size=int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=_int(meta, f"{arch}.feed_forward_length"),
        num_layers=_int(meta, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(meta.get(f"{arch}.rope.dimension_count") or hidden // heads),
        max_position_embeddings=_int(meta, f"{arch}.context_length"),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        tie_word_embeddings="output.weight" not in names,
        eos_token_ids=() if eos is None else (int(eos),),
    )


def load_gguf_weights(model: LlamaModel, gguf: GGUFFile, sources: GGUFSources | None = None) -> None:
    """Dequantize every tensor of ``gguf`` into ``model`` (its dtype and device); a missing or
    unexpected weight is a ModelLoadError. ``sources`` (when given) collects each tensor's GGUF type
    and the int4 codes of its Q4_0/Q4_1 tensors, for the quantized modes (engine/quantize.py)."""
    params = dict(model.named_parameters())
    cfg = model.config
    loaded: set[str] = set()
    for tensor in gguf.tensors():
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None:
            raise ModelLoadError(f"{gguf.path}: unexpected tensor {tensor.name!r}")
        values = tensor.dequantize()
        heads = _qk_heads(hf_name, cfg.num_heads, cfg.num_kv_heads)
        if heads:
            values = unpermute_qk(values, heads)
        if sources is not None:
            sources.add(hf_name, tensor, heads)
        target = copy_hf_tensor(model, params, hf_name, torch.from_numpy(values))
        if target is not None:
            loaded.add(target)
    missing = expected_names(params) - loaded
    if missing:
        raise ModelLoadError(f"{gguf.path}: weights missing from the file: {sorted(missing)[:5]}")


@dataclasses.dataclass
class GGUFSources:
    """Per HF weight name: its GGUF type, and for Q4_0/Q4_1 its codes (rows in HF order)."""

    types: dict[str, str] = dataclasses.field(default_factory=dict)
    int4: dict[str, Int4Groups] = dataclasses.field(default_factory=dict)

    def add(self, hf_name: str, tensor: GGUFTensor, qk_heads: int) -> None:
        self.types[hf_name] = tensor.type_name
        if tensor.type_name in ("Q4_0", "Q4_1") and len(tensor.shape) == 2:
            groups = gguf_q4_groups(tensor.raw, tensor.type_name, (tensor.shape[0], tensor.shape[1]))
            if qk_heads:
                order = unpermute_qk(np.arange(tensor.shape[0])[:, None], qk_heads)[:, 0]
                groups = groups.rows(order)
            self.int4[hf_name] = groups


def _qk_heads(hf_name: str, num_heads: int, num_kv_heads: int) -> int:
    """Heads whose rows llama.cpp permuted (0: not a q/k weight)."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return num_heads
    return num_kv_heads if hf_name.endswith("self_attn.k_proj.weight") else 0


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``; None for an unknown name."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    match = _BLOCK_NAME.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK:
        return None
    return f"layers.{match.group(1)}.{_BLOCK[match.group(2)]}.{match.group(3)}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (d0, d_half, d1, d_half+1, ...) back to
    (d0, d1, ..., d_half, ...). ``weight``: [num_heads * head_dim, in]."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def _rope_scaling(meta: GGUFMetadata, arch: str) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(meta.require(f"{arch}.rope.scaling.factor")))
    raise ModelLoadError(f"{meta.path}: RoPE scaling {kind!r} is not supported (none, linear)")


def _int(meta: GGUFMetadata, key: str) -> int:
    value = meta.require(key)
    if not isinstance(value, (int, np.integer)):
        raise ModelLoadError(f"{meta.path}: {key} must be one integer, got {value!r}")
    return int(value)
