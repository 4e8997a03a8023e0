"""Weights: load a local HF directory (config.json + *.safetensors) or initialise random weights.

HF checkpoints keep q/k/v and gate/up separate; :class:`LlamaModel` fuses them, so the loader copies
each HF tensor into its slice of the fused parameter.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kvwire.engine.models.config import ModelConfig
from kvwire.engine.models.llama import LlamaModel
from kvwire.errors import ModelLoadError

# HF name suffix -> (our parameter, index of the slice within the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


def read_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (expected a local Hugging Face model directory)")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def load_hf_weights(model: LlamaModel, model_dir: Path) -> None:
    """Copy every tensor of ``model_dir/*.safetensors`` into ``model``; missing weights are an error."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = copy_hf_tensor(model, params, name, f.get_tensor(name))
                if target is not None:
                    loaded.add(target)
    missing = expected_names(params) - loaded
    if missing:
        raise ModelLoadError(f"{model_dir}: weights missing from the checkpoint: {sorted(missing)[:5]}")


def copy_hf_tensor(
    model: LlamaModel, params: dict[str, torch.nn.Parameter], hf_name: str, tensor: torch.Tensor
) -> str | None:
    name = hf_name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and model.lm_head is None:
        # Tied embeddings: one tensor under either name (safetensors.torch.save_model keeps only
        # lm_head.weight); a checkpoint holding both holds the same values twice.
        name = "embed_tokens.weight"
    match = _LAYER.match(name)
    if match and match.group(2) in _FUSED:
        fused, index = _FUSED[match.group(2)]
        name = f"layers.{match.group(1)}.{fused}.{match.group(3)}"
        param = params[name]
        cfg = model.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = (q_size, kv_size, kv_size) if "qkv" in fused else (cfg.intermediate_size,) * 2
        start = sum(sizes[:index])
        _checked_copy(param.data[start : start + sizes[index]], tensor, hf_name)
        return f"{name}[{index}]"  # each slice of a fused parameter must arrive
    if name not in params:
        raise ModelLoadError(f"unexpected weight {hf_name!r} in the checkpoint")
    _checked_copy(params[name].data, tensor, hf_name)
    return name


def expected_names(params: dict[str, torch.nn.Parameter]) -> set[str]:
    """What a complete checkpoint fills: every parameter, every slice of the fused ones."""
    names: set[str] = set()
    for name in params:
        num_slices = 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 0
        names |= {f"{name}[{i}]" for i in range(num_slices)} if num_slices else {name}
    return names


def _checked_copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def init_random_weights(model: LlamaModel, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: norms 1, biases 0, everything else N(0, std) from ``seed``
    (a generator on the parameters' device, so the same seed gives the same weights per device)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
