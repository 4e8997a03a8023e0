"""The native int8 kernel (decision 157): equal to ``bf16(x) . q^T * scale`` within float32 rounding
over many shapes, each row's result independent of its batch bit for bit, bad input refused before
anything is computed, and its fallback (torch's kernel, one warning) close to it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvwire.engine import quant
from kvwire.engine.quant import Int4Linear, Int8Linear, pack_int8, quantize_int4, unpack_int8

needs_kernel = pytest.mark.skipif(not quant.NATIVE_QUANT, reason=quant.NATIVE_QUANT_ERROR or "runs")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The native kernels are taken by layers built in a process of one torch thread (the CPU
    engine's default on a 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cpu_has_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text()


def test_the_kernel_is_built_and_runs_where_the_cpu_can() -> None:
    """``pip install`` builds the extension wherever a C compiler is found (CI's included); on a CPU
    with AVX512-BF16 the int8 layers multiply by it."""
    import kvwire.engine._quant_matmul as native

    assert native.supported() == _cpu_has_bf16()
    assert _cpu_has_bf16() == quant.NATIVE_QUANT, quant.NATIVE_QUANT_ERROR


@pytest.mark.parametrize(("rows", "cols"), [(1, 2), (5, 6), (16, 64), (17, 96), (40, 130), (96, 576)])
def test_pack_and_unpack_round_trip(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
    packed = pack_int8(codes)
    assert packed.numel() == -(-rows // 16) * 16 * cols
    assert torch.equal(unpack_int8(packed, rows, cols), codes)


def _native_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    assert quant._quant_native is not None
    out = torch.empty(x.shape[0], codes.shape[0])
    quant._quant_native.mm8(out.numpy(), x.numpy(), pack_int8(codes).numpy(), scale.numpy(), x.shape[0],
                          codes.shape[0], codes.shape[1])  # fmt: skip
    return out


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 48, 100, 960])
@pytest.mark.parametrize("k", [2, 6, 64, 130, 576])
def test_kernel_matches_the_reference_and_rows_are_independent(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g).to(torch.bfloat16).float() + 0.01
    x = torch.randn(19, k, generator=g) * 3
    out = _native_mm(x, codes, scale)
    expected = (x.to(torch.bfloat16).double() @ codes.double().t()) * scale.double()
    # float32 accumulation over k products of bf16 x int8 (each exact in float32)
    magnitude = (x.to(torch.bfloat16).double().abs() @ codes.double().abs().t()) * scale.double()
    bound = 1e-6 * k * magnitude + 1e-30
    assert ((out.double() - expected).abs() <= bound).all()
    for batch in (1, 3, 8, 9, 16):  # a row gives the same bits alone and in batches of any size
        parts = [_native_mm(x[i : i + batch].contiguous(), codes, scale) for i in range(0, 19, batch)]
        part = torch.cat(parts)
        assert torch.equal(part, out), batch


@needs_kernel
def test_kernel_refuses_bad_sizes_before_computing() -> None:
    assert quant._quant_native is not None
    mm = quant._quant_native.mm8
    codes = pack_int8(torch.ones(16, 8, dtype=torch.int8)).numpy()
    x, scale = np.ones((2, 8), np.float32), np.ones(16, np.float32)
    out = np.full((2, 16), 7.0, np.float32)
    with pytest.raises(ValueError, match="even k"):
        mm(out, np.ones((2, 7), np.float32), codes[:112], scale, 2, 16, 7)
    with pytest.raises(ValueError, match="positive"):
        mm(out, x, codes, scale, 0, 16, 8)
    for bad in ((out[:1], x, codes, scale), (out, x[:1], codes, scale), (out, x, codes[:-1], scale),
                (out, x, codes, scale[:8])):  # fmt: skip
        with pytest.raises(ValueError, match="disagree"):
            mm(*bad, 2, 16, 8)
    assert (out == 7.0).all()
    with pytest.raises(TypeError):
        mm(out.astype(np.float64).tobytes(), x, codes, scale, 2, 16, 8)  # read-only bytes for out


@needs_kernel
def test_int8_layer_runs_the_kernel_close_to_torchs() -> None:
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(8))
    layer = Int8Linear(w)
    assert layer.native and layer.qweight.dim() == 1  # kept in the kernel's tiles
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(9))
    out = layer(x)
    torch_out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), layer.codes(), layer.scale).float()
    scale = torch_out.abs().max()
    assert (out - torch_out).abs().max() <= 0.01 * scale  # torch rounds its output to bf16
    assert torch.equal(layer(x[3:4]), out[3:4])
    assert torch.allclose(layer.dequantize(), layer.codes().float() * layer.scale.float()[:, None])
    _close(out, F.linear(x, w), 0.03)


def _int4_case(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.1 + 1e-3).to(torch.bfloat16)
    zero = (torch.randn(n, k // 32, generator=g) * 0.3).to(torch.bfloat16)
    return codes, scale, zero


def _native_mm4(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], n: int) -> torch.Tensor:
    assert quant._quant_native is not None
    out = torch.empty(x.shape[0], n)
    codes, halves = packed
    quant._quant_native.mm4(out.numpy(), x.numpy(), codes.numpy(), halves.view(torch.int16).numpy(),
                            x.shape[0], n, x.shape[1])  # fmt: skip
    return out


@needs_kernel
@pytest.mark.parametrize("n", [16, 32, 48, 960])
@pytest.mark.parametrize("k", [32, 64, 576, 1536])
def test_int4_kernel_matches_the_reference_and_rows_are_independent(n: int, k: int) -> None:
    codes, scale, zero = _int4_case(n, k, n * 7 + k)
    packed = quant.pack_int4(codes, scale, zero)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(k)) * 3
    out = _native_mm4(x, packed, n)
    s, z = (t.float().repeat_interleave(32, 1).double() for t in (scale, zero))
    xb = x.to(torch.bfloat16).double()
    expected = xb @ ((codes.double() - 8) * s + z).t()
    # float32 sums of (128 + q) x per group, the offset taken back: ~136 |scale| + |zero| per weight
    bound = 2e-6 * k * (xb.abs() @ (136 * s.abs() + z.abs()).t())
    assert ((out.double() - expected).abs() <= bound).all()
    for batch in (1, 4, 8, 9):
        parts = [_native_mm4(x[i : i + batch].contiguous(), packed, n) for i in range(0, 13, batch)]
        assert torch.equal(torch.cat(parts), out), batch


@needs_kernel
def test_int4_kernel_refuses_bad_sizes_before_computing() -> None:
    assert quant._quant_native is not None
    mm4 = quant._quant_native.mm4
    codes, halves = quant.pack_int4(*_int4_case(16, 64, 1))
    c, h = codes.numpy(), halves.view(torch.int16).numpy()
    x, out = np.ones((2, 64), np.float32), np.full((2, 16), 7.0, np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        mm4(out, np.ones((2, 48), np.float32), c[:384], h, 2, 16, 48)
    for bad in ((out[:1], x, c, h), (out, x[:1], c, h), (out, x, c[:-1], h), (out, x, c, h[:-1])):
        with pytest.raises(ValueError, match="disagree"):
            mm4(*bad, 2, 16, 64)
    assert (out == 7.0).all()


@needs_kernel
def test_int4_layer_runs_the_kernel_close_to_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(12))
    groups = quantize_int4(w.numpy())
    layer = Int4Linear(groups, 96, 40, dense=True)
    assert layer.native
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(13))
    out = layer(x)
    assert torch.equal(layer(x[2:3]), out[2:3])
    monkeypatch.setattr(quant, "_quant_native", None)
    torch_out = Int4Linear(groups, 96, 40)(x)
    _close(out, torch_out, 0.01)  # torch rounds its output to bf16
    _close(out, F.linear(x, torch.from_numpy(groups.dequantize())), 0.02)


def test_without_the_kernel_quantized_layers_run_torch_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(quant, "_quant_native", None)
    monkeypatch.setattr(quant, "_warned_quant", [])
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(10))
    with caplog.at_level(logging.WARNING, logger="kvwire.engine.quant"):
        first, second = Int8Linear(w), Int8Linear(w)
        four = Int4Linear(quantize_int4(w.numpy()), 64, 40)
    assert len(caplog.records) == 1 and "torch's weight-only kernels" in caplog.records[0].message
    assert not first.native and first.qweight.shape == (40, 64) and not four.native
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(11))
    _close(first(x), F.linear(x, first.dequantize()), 0.02)
    assert torch.equal(first(x), second(x))
    _close(four(x), F.linear(x, w), 0.1)


@needs_kernel
def test_several_torch_threads_keep_torchs_kernels(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(quant, "_warned_quant", [])
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(14))
    torch.set_num_threads(2)
    with caplog.at_level(logging.WARNING, logger="kvwire.engine.quant"):
        layer = Int8Linear(w)
    assert not layer.native and "2 torch threads" in caplog.records[0].message
    assert quant.describe_kernels(2).startswith("torch (single-threaded")
    assert quant.describe_kernels(1) == "native (AVX512-BF16)"
    torch.set_num_threads(1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(15))
    _close(layer(x), Int8Linear(w)(x), 0.01)


def _close(out: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert (out - expected).abs().max() <= tolerance * expected.abs().max()
