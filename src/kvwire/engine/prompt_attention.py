"""Causal attention of whole prompts on the CPU: the C kernel ``_prompt_attention.c`` (decision 152).

A step's whole prompts (no earlier KV: they attend over their own fresh K/V) are computed by one call
for all of them, reading q, k and v where the layer left them (views of the fused qkv projection: no
copy, no GQA expansion); torch's SDPA took one call per prompt at ~45 GFLOP/s. The paged backend uses
it on the CPU in float32 for head sizes 64 and 128 (:func:`fits`); elsewhere, or where the kernel is
not built (:data:`NATIVE_PROMPT`), prompts take SDPA as before.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

log = logging.getLogger(__name__)

_native: ModuleType | None
try:
    _native = importlib.import_module("kvwire.engine._prompt_attention")
    NATIVE_PROMPT_ERROR = ""
except ImportError as exc:  # built without a C compiler: torch's SDPA per prompt
    _native = None
    NATIVE_PROMPT_ERROR = str(exc)

#: True when the native prompt kernel is built (docs/decisions/152-prompt-attention-kernel.md)
NATIVE_PROMPT = _native is not None
_DIMS: tuple[int, ...] = tuple(_native.prompt_dims) if _native is not None else ()

_warned = False

Rows = tuple[npt.NDArray[Any], int, int]  # a flat float32 buffer, first row's offset, row stride


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel computes these ([T, heads, D] float32 on the CPU, D one it takes)."""
    return (
        _native is not None
        and q.shape[-1] in _DIMS
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
    )


def warn_if_missing() -> None:
    """Log once that prompts take torch's SDPA because the kernel is not built."""
    global _warned
    if _native is None and not _warned:
        _warned = True
        log.warning(
            "prompt attention runs torch SDPA once per prompt (the native kernel is not built: %s); "
            "reinstall kvwire where a C compiler is available",
            NATIVE_PROMPT_ERROR,
        )


def prompt_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: npt.NDArray[np.int64],
    lens: npt.NDArray[np.int64],
) -> None:
    """Rows ``starts[i] .. starts[i] + lens[i]`` of ``out`` ([T, Hq, D], contiguous): each whole
    prompt's causal attention over its own rows of ``k``/``v`` ([T, Hkv, D]); other rows untouched."""
    assert _native is not None
    tokens, heads, dim = q.shape
    (qb, qo, qr), (kb, ko, kr), (vb, vo, vr) = _rows(q), _rows(k), _rows(v)
    kv_heads, scale = k.shape[1], dim**-0.5
    _native.prompt(
        out.numpy(), qb, qo, qr, kb, ko, kr, vb, vo, vr, starts, lens, tokens, heads, kv_heads, dim, scale
    )


def _rows(t: torch.Tensor) -> Rows:
    """``t`` ([T, H, D]) as the kernel reads it: its storage as a flat float32 buffer, the offset of
    its first row, the floats between rows. A layout whose heads do not lie together is copied."""
    if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) < t.shape[1] * t.shape[2]:
        t = t.contiguous()
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    return flat.numpy(), int(t.storage_offset()), int(t.stride(0))
