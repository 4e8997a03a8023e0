"""Builds the model and tokenizer an EngineConfig names: a random-weight preset, a packaged model
(``smollm2-135m``), a GGUF file or a local HF directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvwire import hub
from kvwire.engine.config import EngineConfig
from kvwire.engine.gguf_reader import GGUFFile
from kvwire.engine.gguf_tokenizer import gguf_tokenizer
from kvwire.engine.gguf_weights import gguf_model_config, load_gguf_weights
from kvwire.engine.models.llama import LlamaModel
from kvwire.engine.models.presets import PACKAGED_MODELS, PRESETS, Preset
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


_Built = tuple[LlamaModel, Tokenizer, int]  # model, tokenizer, default max_model_len


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.is_cuda else torch.float32
    return _DTYPES[config.dtype]


def load_model(config: EngineConfig) -> LoadedModel:
    """Raises ModelLoadError when the preset, file or directory cannot be used."""
    device, dtype = torch.device(config.device), resolve_dtype(config)
    if config.model in PRESETS:
        model, tokenizer, default_len = _load_preset(PRESETS[config.model], device, dtype)
    elif config.model in PACKAGED_MODELS:
        path = PACKAGED_MODELS[config.model].path(config.model)
        model, tokenizer, default_len = _load_gguf(path, device, dtype)
    elif config.model.endswith(".gguf") or Path(config.model).is_file():
        model, tokenizer, default_len = _load_gguf(Path(config.model), device, dtype)
    elif Path(config.model).is_dir():
        model, tokenizer, default_len = _load_hf_dir(Path(config.model), device, dtype)
    elif hub.is_repo_id(config.model):
        path = hub.resolve(config.model, config.revision, config.gguf_file)
        model, tokenizer, default_len = _load_local(path, device, dtype)
    else:
        names = ", ".join([*PRESETS, *PACKAGED_MODELS])
        raise ModelLoadError(
            f"{config.model!r} is neither a model name ({names}), a .gguf file, a directory nor a "
            "Hugging Face model id (ORG/NAME)"
        )
    if config.tokenizer is not None:
        tokenizer = HFTokenizer.from_dir(hub.resolve_tokenizer(config.tokenizer, None),
                                         list(model.config.eos_token_ids))
    limit = model.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
    max_model_len = min(config.max_model_len or default_len, limit)
    return LoadedModel(model.eval(), tokenizer, dtype, max_model_len)


def _load_local(path: Path, device: torch.device, dtype: torch.dtype) -> _Built:
    """A checkpoint the Hugging Face cache resolved to: a .gguf file or a safetensors directory."""
    return _load_gguf(path, device, dtype) if path.is_file() else _load_hf_dir(path, device, dtype)


def _load_preset(preset: Preset, device: torch.device, dtype: torch.dtype) -> _Built:
    if preset.init_on_cpu:  # same weights whatever the device
        model = LlamaModel(preset.config)
        init_random_weights(model, preset.seed, preset.init_std)
        model = model.to(device=device, dtype=dtype)
    else:
        model = LlamaModel(preset.config, device=device, dtype=dtype)
        init_random_weights(model, preset.seed, preset.init_std)
    return model, ByteTokenizer(), preset.default_max_model_len


def _load_hf_dir(model_dir: Path, device: torch.device, dtype: torch.dtype) -> _Built:
    model_config = read_model_config(model_dir)
    model = LlamaModel(model_config, device=device, dtype=dtype)
    load_hf_weights(model, model_dir)
    tokenizer = HFTokenizer.from_dir(model_dir, list(model_config.eos_token_ids))
    return model, tokenizer, min(model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> _Built:
    gguf = GGUFFile(path)
    model_config = gguf_model_config(gguf)
    tokenizer = gguf_tokenizer(gguf.metadata, model_config.eos_token_ids)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model {model_config.vocab_size}"
        )
    model = LlamaModel(model_config, device=device, dtype=dtype)
    load_gguf_weights(model, gguf)
    return model, tokenizer, min(model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
