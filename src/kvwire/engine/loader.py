"""Builds the model and tokenizer an EngineConfig names: a random-weight preset, a packaged model
(``smollm2-135m``), a GGUF file or a local HF directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvwire import hub
from kvwire.engine.config import EngineConfig, Quantization
from kvwire.engine.gguf_reader import GGUFFile
from kvwire.engine.gguf_tokenizer import gguf_tokenizer
from kvwire.engine.gguf_weights import GGUFSources, gguf_model_config, load_gguf_weights
from kvwire.engine.models.llama import LlamaModel
from kvwire.engine.models.presets import PACKAGED_MODELS, PRESETS, Preset
from kvwire.engine.quantize import quantize_model, resolve_quantization
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
    quantization: Quantization = Quantization.NONE  # the mode in effect (AUTO resolved)


_Built = tuple[LlamaModel, Tokenizer, int]  # model, tokenizer, default max_model_len


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.is_cuda else torch.float32
    return _DTYPES[config.dtype]


def load_model(config: EngineConfig) -> LoadedModel:
    """Raises ModelLoadError when the preset, file or directory cannot be used."""
    device, dtype = torch.device(config.device), resolve_dtype(config)
    path = None if config.model in PRESETS else _checkpoint_path(config)
    is_gguf = path is not None and (path.suffix == ".gguf" or path.is_file())
    on_cpu = device.type == "cpu"
    mode = resolve_quantization(config.quantization, is_gguf, on_cpu, config.tensor_parallel_size)
    if mode is Quantization.GGUF and not is_gguf:
        raise ConfigError(f"quantization 'gguf' needs a GGUF model, not {config.model!r} (use int8 or int4)")
    dense_prompts = config.dense_prompt_weights
    if path is None:
        model, tokenizer, default_len = _load_preset(PRESETS[config.model], device, dtype)
        quantize_model(model, mode, None, dense_prompts=dense_prompts)
    elif is_gguf:
        model, tokenizer, default_len = _load_gguf(path, device, dtype, mode, dense_prompts)
    else:
        model, tokenizer, default_len = _load_hf_dir(path, device, dtype)
        quantize_model(model, mode, None, dense_prompts=dense_prompts)
    if config.tokenizer is not None:
        tokenizer = HFTokenizer.from_dir(hub.resolve_tokenizer(config.tokenizer, None),
                                         list(model.config.eos_token_ids))
    limit = model.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
    max_model_len = min(config.max_model_len or default_len, limit)
    return LoadedModel(model.eval(), tokenizer, dtype, max_model_len, mode)


def _checkpoint_path(config: EngineConfig) -> Path:
    """The GGUF file or HF directory ``config.model`` names (a packaged model, a path, or a Hugging
    Face model id resolved through the cache)."""
    model = config.model
    if model in PACKAGED_MODELS:
        return PACKAGED_MODELS[model].path(model)
    if model.endswith(".gguf") or Path(model).is_file() or Path(model).is_dir():
        return Path(model)
    if hub.is_repo_id(model):
        return hub.resolve(model, config.revision, config.gguf_file)
    names = ", ".join([*PRESETS, *PACKAGED_MODELS])
    raise ModelLoadError(
        f"{model!r} is neither a model name ({names}), a .gguf file, a directory nor a "
        "Hugging Face model id (ORG/NAME)"
    )


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


def _load_gguf(
    path: Path, device: torch.device, dtype: torch.dtype, mode: Quantization, dense_prompts: bool
) -> _Built:
    gguf = GGUFFile(path)
    model_config = gguf_model_config(gguf)
    tokenizer = gguf_tokenizer(gguf.metadata, model_config.eos_token_ids)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model {model_config.vocab_size}"
        )
    model = LlamaModel(model_config, device=device, dtype=dtype)
    sources = None if mode is Quantization.NONE else GGUFSources()
    load_gguf_weights(model, gguf, sources)
    quantize_model(model, mode, sources, dense_prompts=dense_prompts)
    return model, tokenizer, min(model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
