"""Weight-only quantized linear layers for the CPU: int4 in groups of 32 and int8 per output row.

The weights stay packed in memory and are multiplied by torch's own CPU kernels
(``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``), which read them as they are and
take bfloat16 activations (their float32 entry points run a slow generic path). A layer casts its
input to bfloat16 and its output back, so the rest of the model keeps its dtype.

* :class:`Int4Linear` — ``w = (q - 8) * scale + zero`` per group of 32 inputs, ``q`` in 0..15. GGUF's
  Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``) blocks map onto it without re-quantizing: the
  codes are the file's codes, only the scales are rounded to bfloat16 (:func:`gguf_q4_groups`).
* :class:`Int8Linear` — ``w = q * scale`` per output row, ``q`` in -127..127. GGUF's Q8_0 blocks
  (a scale per 32 inputs) are re-quantized to one scale per row from their dequantized values.

Where the CPU has AVX512-BF16 and kvwire was built with a C compiler, both keep their codes in tiles
of 16 rows and are multiplied by a small C kernel instead (``_quant_matmul.c``, decision 157: about
twice as fast as torch's at 8 rows, float32 out, the same codes and scales); torch's kernels
otherwise (:data:`NATIVE_QUANT`), and in a process of several torch threads (the kernel is
single-threaded; torch's split the rows), with one warning.

Decision 118 says why these kernels and this layout.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvwire.errors import ModelLoadError

GROUP = 32  # inputs per int4 group: GGUF's block size
_ROWS_MULTIPLE = 16  # the int4 packer wants the output rows in multiples of 16
_ACT = torch.bfloat16
# The kernels' overloads, resolved once: calling an overload skips the packet's resolution per call
# (decision 154). None where this torch lacks one (a layer of that kind then fails when it runs).
_INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_INT8_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
_INT4_MM = None if _INT4_MM is None else _INT4_MM.default
_INT8_MM = None if _INT8_MM is None else _INT8_MM.default
_TILE = 16  # output rows of one tile of the native kernels' layouts (pack_int8, pack_int4)
log = logging.getLogger(__name__)


def _quant_kernel() -> tuple[ModuleType | None, str]:
    """The native int8/int4 kernels (decision 157), or None and why not."""
    try:
        module = importlib.import_module("kvwire.engine._quant_matmul")
    except ImportError as exc:  # built without a C compiler
        return None, str(exc)
    if module.supported():
        return module, ""
    return None, "no AVX512-BF16 on this CPU, or a build without it (GCC >= 10 on x86-64 compiles it)"


_quant_native, NATIVE_QUANT_ERROR = _quant_kernel()
#: True when int8 and int4 layers multiply by the native kernels (docs/decisions/157-quantized-decode-gemm.md)
NATIVE_QUANT = _quant_native is not None
_warned_quant: list[bool] = []  # the fallback logged


def describe_kernels(threads: int = 1) -> str:
    """Which kernels multiply the packed rows of quantized layers built in a process of ``threads``
    torch threads, for logs and benchmark tables."""
    why = _runs_native(threads)
    return f"torch ({why})" if why else "native (AVX512-BF16)"


def _runs_native(threads: int | None = None) -> str:
    """Why a layer built now keeps torch's kernels, or "" when it takes the native one: that is
    single-threaded, so a process of several torch threads keeps torch's, which split the rows."""
    if _quant_native is None:
        return NATIVE_QUANT_ERROR or "not loaded"
    threads = torch.get_num_threads() if threads is None else threads
    return "" if threads == 1 else f"single-threaded; this process runs {threads} torch threads"


def _warn_torch(why: str) -> None:
    if not _warned_quant:
        _warned_quant.append(True)
        log.warning("quantized layers run torch's weight-only kernels (the native kernel: %s)", why)


# A layer's native product: the kernel (mm8 or mm4) and its weight arrays, numpy views of the
# layer's buffers taken once at build (a step calls it for every quantized layer)
NativeCall = tuple[Callable[..., None], tuple[np.ndarray, ...]]


def _native_call(kernel: str, *weight: torch.Tensor | np.ndarray) -> NativeCall:
    assert _quant_native is not None  # a layer is native only where the kernel loaded
    arrays = tuple(w.numpy() if isinstance(w, torch.Tensor) else w for w in weight)
    return getattr(_quant_native, kernel), arrays


def _native_mm(call: NativeCall, flat: torch.Tensor, out_features: int) -> torch.Tensor:
    """``flat`` [rows, in] times a weight in the native kernel's layout, float32 [rows, out]."""
    rows = flat.shape[0]
    out = torch.empty(rows, out_features)
    if rows:
        kernel, weight = call
        x = flat.to(torch.float32).contiguous()
        kernel(out.numpy(), x.numpy(), *weight, rows, out_features, x.shape[1])
    return out


def pack_int4(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4 codes [N, K] (0..15, N a multiple of 16) and the bfloat16 scale and zero [N, K / 32] of
    ``w = (q - 8) * scale + zero`` in the native kernel's layout: tiles of 16 rows, each [K / 2, 16]
    bytes (even input in the low nibble), and [tiles, K / 32, 2, 16] scales then zeros."""
    rows, cols = codes.shape
    pairs = codes.to(torch.uint8).view(rows // _TILE, _TILE, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2).contiguous().view(-1)
    halves = torch.stack([scale.view(-1, _TILE, cols // GROUP), zero.view(-1, _TILE, cols // GROUP)], 2)
    return packed, halves.permute(0, 3, 2, 1).contiguous().view(-1)


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """Int8 codes [N, K] (K even) in the native kernel's layout: tiles of 16 rows (N padded with zero
    rows), each [K / 2, 16, 2]: for each input pair the 16 rows' two codes side by side."""
    rows, cols = codes.shape
    padded = F.pad(codes, (0, 0, 0, -rows % _TILE))
    return padded.view(-1, _TILE, cols // 2, 2).transpose(1, 2).contiguous().view(-1)


def unpack_int8(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The codes [rows, cols] that :func:`pack_int8` laid out."""
    return packed.view(-1, cols // 2, _TILE, 2).transpose(1, 2).reshape(-1, cols)[:rows]


@dataclasses.dataclass
class Int4Groups:
    """A weight as int4 codes with a scale and an offset per group: ``w = scale * q + offset``
    (float32 numpy arrays; codes uint8 [N, K], scale/offset [N, K / GROUP])."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    def dequantize(self) -> np.ndarray:
        rep = np.repeat
        return rep(self.scale, GROUP, 1) * self.codes.astype(np.float32) + rep(self.offset, GROUP, 1)

    def rows(self, index: np.ndarray) -> Int4Groups:
        return Int4Groups(self.codes[index], self.scale[index], self.offset[index])

    @staticmethod
    def concat(parts: list[Int4Groups]) -> Int4Groups:
        fields = ("codes", "scale", "offset")
        return Int4Groups(*(np.concatenate([getattr(p, f) for p in parts]) for f in fields))


def gguf_q4_groups(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Groups:
    """The codes and scales of a Q4_0 or Q4_1 tensor as stored (``raw``: the file's bytes, one row
    per output row). Q4_0 block: fp16 d, 16 bytes of nibbles; Q4_1: fp16 d, fp16 m, 16 bytes. Element
    j of a block is the low nibble of byte j, element j + 16 the high nibble."""
    header = {"Q4_0": 2, "Q4_1": 4}[type_name]
    rows, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP, header + GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., header:]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols)
    if type_name == "Q4_0":
        return Int4Groups(codes, d, -8.0 * d)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return Int4Groups(codes, d, m)


def quantize_int4(weight: np.ndarray) -> Int4Groups:
    """Round-to-nearest asymmetric int4 per group of 32 (the Q4_1 recipe) for float weights."""
    rows, cols = weight.shape
    groups = weight.astype(np.float32).reshape(rows, cols // GROUP, GROUP)
    low, high = groups.min(-1), groups.max(-1)
    scale = (high - low) / 15.0
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.clip(np.rint((groups - low[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    return Int4Groups(codes.reshape(rows, cols), scale, low)


@dataclasses.dataclass
class RowSplit:
    """Shared by a model's quantized layers, set by the model runner for each forward: the first
    ``packed_rows`` rows (the decodes) go through the packed kernel, the rest (prompt rows) through
    the layer's bfloat16 copy when it has one. None: every row packed."""

    packed_rows: int | None = None


class _QuantLinear(nn.Module):
    """What the int4 and int8 layers share: the row split, the optional dense copy, the bias."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 split: RowSplit | None) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.split = in_features, out_features, split
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # bf16 [out, in] for prompt rows (``dense=True``: faster than the packed kernels on many rows;
        # costs 2 bytes per weight)
        self.dense_weight: torch.Tensor | None
        self.register_buffer("dense_weight", None)

    def _keep_dense(self, weight: torch.Tensor) -> None:
        self.dense_weight = weight.to(_ACT).contiguous()

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        two_d = x.dim() == 2
        flat = x if two_d else x.reshape(-1, self.in_features)
        rows, dense = flat.shape[0], self.dense_weight
        split = self.split.packed_rows if self.split is not None else None
        packed = rows if split is None or dense is None else min(split, rows)
        if packed == rows or dense is None:
            out = self._packed(flat).to(x.dtype)
        elif packed == 0:
            out = F.linear(flat.to(_ACT), dense).to(x.dtype)
        else:
            dense_rows = F.linear(flat[packed:].to(_ACT), dense).to(x.dtype)
            out = torch.cat((self._packed(flat[:packed]).to(x.dtype), dense_rows))
        if not two_d:
            out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


class Int4Linear(_QuantLinear):
    """``y = x W^T`` with W held as packed int4 groups (see the module docstring)."""

    def __init__(
        self, groups: Int4Groups, in_features: int, out_features: int, bias: torch.Tensor | None = None,
        split: RowSplit | None = None, dense: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias, split)
        rows, cols = groups.codes.shape
        if cols % GROUP or (rows, cols) != (out_features, in_features):
            raise ModelLoadError(
                f"int4 weight {rows}x{cols}: needs {out_features}x{in_features}, K % {GROUP} == 0"
            )
        pad = -rows % _ROWS_MULTIPLE
        codes = torch.from_numpy(np.pad(groups.codes, ((0, pad), (0, 0))).astype(np.int32))
        scale = torch.from_numpy(np.pad(groups.scale, ((0, pad), (0, 0))))
        zero = scale * 8.0 + torch.from_numpy(np.pad(groups.offset, ((0, pad), (0, 0))))  # (q-8)*s+zero
        self.padded_rows = pad
        why = _runs_native()
        self.native = not why
        if why:
            _warn_torch(why)
        self.packed: torch.Tensor
        self.scale_zeros: torch.Tensor
        if self.native:  # the kernel's tiles; scale_zeros holds bf16 bits as int16 (numpy has no bf16)
            packed, halves = pack_int4(codes, scale.to(_ACT), zero.to(_ACT))
            self.register_buffer("packed", packed)
            self.register_buffer("scale_zeros", halves.view(torch.int16))
            self._native = _native_call("mm4", self.packed, self.scale_zeros)
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.register_buffer("scale_zeros", torch.stack([scale.t(), zero.t()], -1).to(_ACT).contiguous())
        if dense:  # the weight the kernel multiplies by: bf16 scale and zero
            s, z = (t[:rows].to(_ACT).float().repeat_interleave(GROUP, 1) for t in (scale, zero))
            self._keep_dense((codes[:rows].float() - 8.0) * s + z)

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        if self.native:
            return _native_mm(self._native, flat, self.out_features)
        if _INT4_MM is None:
            raise ModelLoadError("this torch has no aten._weight_int4pack_mm_for_cpu")
        out = _INT4_MM(flat.to(_ACT), self.packed, GROUP, self.scale_zeros)
        return out if self.padded_rows == 0 else out[:, : self.out_features]


class Int8Linear(_QuantLinear):
    """``y = x W^T`` with W held as int8 rows and one scale per row, symmetric. The codes are kept in
    the native kernel's tiles (:func:`pack_int8`) where it runs (:data:`NATIVE_QUANT`, an even number
    of inputs), as torch's kernel reads them otherwise."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, split: RowSplit | None = None,
        dense: bool = False,
    ) -> None:  # fmt: skip
        w = weight.detach().float()
        super().__init__(int(w.shape[1]), int(w.shape[0]), bias, split)
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        why = _runs_native() or ("" if self.in_features % 2 == 0 else f"odd input size {self.in_features}")
        self.native = not why
        if why:
            _warn_torch(why)
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qweight", pack_int8(codes) if self.native else codes)
        self.register_buffer("scale", scale.to(_ACT))
        if self.native:  # the kernel takes the same bf16 scales as float32
            self._native = _native_call("mm8", self.qweight, self.scale.float())
        if dense:
            self._keep_dense(self.dequantize())

    def codes(self) -> torch.Tensor:
        """The int8 codes [out, in], whichever layout holds them."""
        q = self.qweight
        return unpack_int8(q, self.out_features, self.in_features) if self.native else q

    def dequantize(self) -> torch.Tensor:
        return self.codes().float() * self.scale.float()[:, None]

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        if self.native:
            return _native_mm(self._native, flat, self.out_features)
        if _INT8_MM is None:
            raise ModelLoadError("this torch has no aten._weight_int8pack_mm")
        return _INT8_MM(flat.to(_ACT), self.codes(), self.scale)
