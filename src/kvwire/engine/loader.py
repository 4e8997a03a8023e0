"""Builds the model and tokenizer an EngineConfig names: a preset or a local HF directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvwire.engine.config import EngineConfig
from kvwire.engine.models.llama import LlamaModel
from kvwire.engine.models.presets import PRESETS
from kvwire.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvwire.engine.weights import init_random_weights, load_hf_weights, read_model_config
from kvwire.errors import ConfigError, ModelLoadError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_DEFAULT_MODEL_LEN = 8192


@dataclasses.dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    dtype: torch.dtype
    max_model_len: int


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.is_cuda else torch.float32
    return _DTYPES[config.dtype]


def load_model(config: EngineConfig) -> LoadedModel:
    """Raises ModelLoadError when the preset or directory cannot be used."""
    device, dtype = torch.device(config.device), resolve_dtype(config)
    if config.model in PRESETS:
        preset = PRESETS[config.model]
        if preset.init_on_cpu:  # same weights whatever the device
            model = LlamaModel(preset.config)
            init_random_weights(model, preset.seed, preset.init_std)
            model = model.to(device=device, dtype=dtype)
        else:
            model = LlamaModel(preset.config, device=device, dtype=dtype)
            init_random_weights(model, preset.seed, preset.init_std)
        tokenizer: Tokenizer = ByteTokenizer()
        default_len = preset.default_max_model_len
    else:
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise ModelLoadError(
                f"{config.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory"
            )
        model_config = read_model_config(model_dir)
        model = LlamaModel(model_config, device=device, dtype=dtype)
        load_hf_weights(model, model_dir)
        tokenizer = HFTokenizer(model_dir, list(model_config.eos_token_ids))
        default_len = min(model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
    limit = model.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
    max_model_len = min(config.max_model_len or default_len, limit)
    return LoadedModel(model.eval(), tokenizer, dtype, max_model_len)
