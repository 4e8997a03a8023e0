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

Prompt rows (many per step) take another path when the layer keeps a copy for them (``dense=True``):
an int8 x int8 GEMM (``torch._int_mm``) of the rows quantized to int8 one by one, against the weight
re-rounded to int8 per output row after SmoothQuant-style smoothing of its input columns (decision
142); without a calibration, a bfloat16 copy and ``F.linear`` (decision 119).

Decision 118 says why these kernels and this layout.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvwire.errors import ModelLoadError

GROUP = 32  # inputs per int4 group: GGUF's block size
_ROWS_MULTIPLE = 16  # the int4 packer wants the output rows in multiples of 16
_ACT = torch.bfloat16
SMOOTH_ALPHA = 0.5  # how much of the activations' column range moves into the weights (decision 142)


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


def smoothing(
    weight: torch.Tensor, input_absmax: torch.Tensor | None, alpha: float | None = None
) -> torch.Tensor:
    """Per input column ``s = amax|x|^alpha / amax|w|^(1 - alpha)`` (SmoothQuant's migration): prompt
    rows multiply ``x / s`` by ``W * s``, the same product, with the activations' outlier columns
    scaled down before they are rounded to int8 per row. Ones when nothing was calibrated."""
    if input_absmax is None:
        return torch.ones(weight.shape[1], dtype=torch.float32)
    alpha = SMOOTH_ALPHA if alpha is None else alpha
    act = input_absmax.float().clamp_min(1e-5)
    wmax = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    return (act.pow(alpha) / wmax.pow(1.0 - alpha)).float()


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``w ~ q * scale``, q in -127..127 (int8 [N, K], float32 [N])."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


@dataclasses.dataclass
class RowSplit:
    """Shared by a model's quantized layers, set by the model runner for each forward: the first
    ``packed_rows`` rows (the decodes) go through the packed kernel, the rest (prompt rows) through
    the layer's copy for prompt rows when it has one (int8 or bfloat16). None: every row packed."""

    packed_rows: int | None = None


class _QuantLinear(nn.Module):
    """What the int4 and int8 layers share: the row split, the optional int8 copy for prompt rows, the
    bias."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 split: RowSplit | None) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.split = in_features, out_features, split
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # For prompt rows (``dense=True``; decision 142): the weight as int8 [out, in] with a float32
        # scale per output row, its input columns multiplied by ``smooth``, and 1 / smooth per input
        self.prompt_weight: torch.Tensor | None
        self.prompt_scale: torch.Tensor | None
        self.prompt_unsmooth: torch.Tensor | None
        for name in ("prompt_weight", "prompt_scale", "prompt_unsmooth"):
            self.register_buffer(name, None)

    def _keep_for_prompts(self, weight: torch.Tensor, input_absmax: torch.Tensor | None) -> None:
        """``weight``: float32 [out, in], what the packed kernel multiplies by. ``input_absmax``: the
        largest |x| seen per input column on a calibration forward; None: a bfloat16 copy instead."""
        if input_absmax is None:
            self.prompt_weight = weight.to(_ACT).contiguous()
            return
        smooth = smoothing(weight, input_absmax)
        self.prompt_weight, scale = quantize_rows_int8(weight * smooth)
        self.prompt_scale, self.prompt_unsmooth = scale.contiguous(), (1.0 / smooth).contiguous()

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        split = self.split.packed_rows if self.split is not None else None
        packed = rows if split is None or self.prompt_weight is None else min(split, rows)
        if packed == rows:
            out = self._packed(flat.to(_ACT)).to(x.dtype)
        elif packed == 0:
            out = self._prompt_rows(flat).to(x.dtype)
        else:
            out = torch.cat((self._packed(flat[:packed].to(_ACT)).to(x.dtype),
                             self._prompt_rows(flat[packed:]).to(x.dtype)))  # fmt: skip
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias

    def _prompt_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat @ W^T`` for prompt rows. With the int8 copy (float32 out): each row divided by the
        smoothing and quantized to int8 with its own scale, an int8 x int8 GEMM with int32 sums
        (exact), then both scales applied. With the bfloat16 copy: ``F.linear`` in bfloat16. Either
        way a row's result depends on that row alone."""
        assert self.prompt_weight is not None
        if self.prompt_scale is None or self.prompt_unsmooth is None:  # the bfloat16 copy
            return F.linear(flat.to(_ACT), self.prompt_weight)
        x = torch.mul(flat, self.prompt_unsmooth)  # float32 (the buffer's dtype), a new tensor
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(127.0)
        codes = x.div_(scale).round_().to(torch.int8)
        sums = torch._int_mm(codes, self.prompt_weight.t())
        return sums.float().mul_(scale).mul_(self.prompt_scale)


class Int4Linear(_QuantLinear):
    """``y = x W^T`` with W held as packed int4 groups (see the module docstring)."""

    def __init__(
        self, groups: Int4Groups, in_features: int, out_features: int, bias: torch.Tensor | None = None,
        split: RowSplit | None = None, dense: bool = False, input_absmax: torch.Tensor | None = None,
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
        self.packed: torch.Tensor
        self.scale_zeros: torch.Tensor
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scale_zeros", torch.stack([scale.t(), zero.t()], -1).to(_ACT).contiguous())
        if dense:  # the weight the kernel multiplies by (bf16 scale and zero), re-rounded per row to int8
            s, z = (t[:rows].to(_ACT).float().repeat_interleave(GROUP, 1) for t in (scale, zero))
            self._keep_for_prompts((codes[:rows].float() - 8.0) * s + z, input_absmax)

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zeros)
        return out if self.padded_rows == 0 else out[:, : self.out_features]


class Int8Linear(_QuantLinear):
    """``y = x W^T`` with W held as int8 rows and one scale per row, symmetric."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, split: RowSplit | None = None,
        dense: bool = False, input_absmax: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        w = weight.detach().float()
        super().__init__(int(w.shape[1]), int(w.shape[0]), bias, split)
        qweight, scale = quantize_rows_int8(w)
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(_ACT))
        if dense:
            self._keep_for_prompts(self.dequantize(), input_absmax)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)
