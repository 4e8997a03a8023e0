"""ModelConfig: the shapes of a Llama / Qwen2 / Qwen3-family decoder, read from an HF config.json."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvwire.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent scaling (``rope_type: llama3``) or plain ``linear``."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ModelLoadError("head_dim must be even (RoPE)")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Translate an HF ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        model_type = str(hf.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"model_type {model_type!r} is not supported ({SUPPORTED_MODEL_TYPES})")
        if hf.get("mlp_bias"):
            raise ModelLoadError("mlp_bias is not supported")
        if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
            raise ModelLoadError("sliding-window attention is not supported")
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope = dict(hf.get("rope_parameters") or {})  # transformers 5
            scaling = hf.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
            eos = hf.get("eos_token_id")
            return cls(
                model_type=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(scaling),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type") or raw.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw["low_freq_factor"]),
            float(raw["high_freq_factor"]),
            int(raw["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3)")
