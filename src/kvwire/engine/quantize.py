"""Puts a loaded :class:`LlamaModel`'s linear layers into the quantized form a
:class:`~kvwire.engine.config.Quantization` mode names (layers in engine/quant.py, decision 118).

The model is first loaded dense (the oracle-exact weights); each projection and the LM head is then
replaced by an :class:`Int4Linear` or :class:`Int8Linear`, and the dense weight is dropped. A fused
projection (q/k/v, gate/up) is int4 from the file's own codes only when every slice of it was a
Q4_0/Q4_1 tensor; otherwise it is made from the dense values. The embedding table, norms and
biases stay dense (a lookup reads one row per token).
"""

from __future__ import annotations

import torch
from torch import nn

from kvwire.engine.config import Quantization
from kvwire.engine.gguf_weights import GGUFSources
from kvwire.engine.models.llama import LlamaModel
from kvwire.engine.quant import GROUP, Int4Groups, Int4Linear, Int8Linear, RowSplit, quantize_int4

_DENSE_TYPES = ("F32", "F16", "BF16")
_SLICES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


def resolve_quantization(mode: Quantization, is_gguf: bool, on_cpu: bool, tp_size: int) -> Quantization:
    """AUTO -> GGUF for a GGUF file on the CPU with one rank, NONE otherwise."""
    if mode is not Quantization.AUTO:
        return mode
    return Quantization.GGUF if is_gguf and on_cpu and tp_size == 1 else Quantization.NONE


def quantize_model(
    model: LlamaModel, mode: Quantization, sources: GGUFSources | None, *, dense_prompts: bool = False
) -> None:
    """In place. ``sources``: what the GGUF file held (None for other checkpoints).
    ``dense_prompts``: the projections keep a bfloat16 copy for prompt rows (quant.RowSplit)."""
    if mode is Quantization.NONE:
        return
    split = RowSplit() if dense_prompts else None
    with torch.no_grad():
        for index, layer in enumerate(model.layers):
            for fused, parts in _SLICES.items():
                owner_name, attr = fused.rsplit(".", 1)
                owner = layer.get_submodule(owner_name)
                names = [f"layers.{index}.{p}.weight" for p in parts]
                new = _quantized(getattr(owner, attr), mode, names, sources, split)
                if new is not None:
                    setattr(owner, attr, new)
        head_source = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.head = _quantized(_as_linear(weight), mode, [head_source], sources, None)
        model.row_split = split
        if model.head is not None and model.lm_head is not None:
            model.lm_head = None  # the dense copy is no longer read


def _quantized(
    linear: nn.Linear, mode: Quantization, names: list[str], sources: GGUFSources | None,
    split: RowSplit | None,
) -> nn.Module | None:  # fmt: skip
    """The replacement of ``linear`` (None: it stays dense). With ``split``, it keeps a bf16 copy."""
    dense = split is not None
    types = [sources.types.get(n, "F32") for n in names] if sources else ["F32"] * len(names)
    if mode is Quantization.GGUF and all(t in _DENSE_TYPES for t in types):
        return None
    int4_ok = linear.in_features % GROUP == 0
    from_codes = sources is not None and all(n in sources.int4 for n in names)
    if mode is Quantization.INT4 and not int4_ok:
        mode = Quantization.INT8  # a width int4 groups cannot tile
    if from_codes and mode in (Quantization.GGUF, Quantization.INT4):
        assert sources is not None
        groups = Int4Groups.concat([sources.int4[n] for n in names])
    elif mode is Quantization.INT4:
        groups = quantize_int4(linear.weight.detach().float().numpy())
    else:
        return Int8Linear(linear.weight, linear.bias, split, dense)
    return Int4Linear(groups, linear.in_features, linear.out_features, linear.bias, split, dense)


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return layer
