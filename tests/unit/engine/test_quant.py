"""Weight-only quantized layers (engine/quant.py, engine/quantize.py): GGUF Q4_0/Q4_1 codes read
back exactly, the int4/int8 kernels against the dequantized reference (within bfloat16 rounding:
they take bfloat16 activations), the modes' choice of layers, and the configurations refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvwire.engine.attention import ForwardContext
from kvwire.engine.config import EngineConfig
from kvwire.engine.gguf_reader import GGUFFile
from kvwire.engine.gguf_weights import GGUFSources, hf_tensor_name
from kvwire.engine.loader import load_model
from kvwire.engine.quant import (
    GROUP,
    Int4Groups,
    Int4Linear,
    Int8Linear,
    RowSplit,
    gguf_q4_groups,
    quantize_int4,
)
from kvwire.errors import ConfigError
from support.gguf_files import write_tiny_llama

Q = gguf.GGMLQuantizationType


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Within ``rel`` of the output's scale (bfloat16 keeps ~3 significant digits)."""
    err = (actual - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), (err, expected.abs().max().item())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_q4_codes_read_back_exactly(qtype: Q) -> None:
    rng = np.random.default_rng(3)
    values = rng.normal(0.0, 0.5, size=(24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    groups = gguf_q4_groups(raw, qtype.name, values.shape)
    assert groups.codes.dtype == np.uint8 and groups.codes.max() <= 15
    assert groups.scale.shape == (24, 96 // GROUP)
    expected = gguf.quants.dequantize(raw, qtype).reshape(values.shape)
    np.testing.assert_array_equal(groups.dequantize(), expected)


def test_quantize_int4_reproduces_a_q4_1_grid() -> None:
    """Values already on an int4 grid come back unchanged (min/max round-to-nearest)."""
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(16, 64)).astype(np.uint8)
    codes[:, ::GROUP] = 0
    codes[:, 1::GROUP] = 15  # every group spans the whole grid
    grid = Int4Groups(codes, rng.uniform(0.01, 0.1, (16, 2)).astype(np.float32),
                      rng.normal(0, 0.2, (16, 2)).astype(np.float32))  # fmt: skip
    again = quantize_int4(grid.dequantize())
    np.testing.assert_array_equal(again.codes, codes)
    np.testing.assert_allclose(again.dequantize(), grid.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("rows", "batch"), [(48, 1), (40, 5), (264, 3)])  # 40, 264: rows padded to 16
def test_int4_linear_matches_the_dequantized_weight(rows: int, batch: int) -> None:
    rng = np.random.default_rng(rows)
    groups = quantize_int4(rng.normal(0, 0.3, (rows, 128)).astype(np.float32))
    bias = torch.randn(rows)
    layer = Int4Linear(groups, 128, rows, bias)
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, torch.from_numpy(groups.dequantize()), bias)
    out = layer(x)
    assert out.shape == (batch, rows) and out.dtype == torch.float32
    _close(out, expected, 0.02)
    assert torch.equal(layer(x), out)  # deterministic


def test_int8_linear_matches_its_dequantized_weight_and_the_original() -> None:
    w = torch.randn(72, 96, generator=torch.Generator().manual_seed(2))
    layer = Int8Linear(w)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    _close(out, F.linear(x, layer.dequantize()), 0.02)
    _close(out, F.linear(x, w), 0.03)  # per-row int8 of a normal weight: well under 1% per weight
    assert torch.equal(layer(x[:1]), layer(x[:1]))


def _kinds(model: torch.nn.Module) -> dict[str, str]:
    layer = model.layers[0]  # type: ignore[index]
    head = model.head  # type: ignore[union-attr]
    return {
        "qkv": type(layer.self_attn.qkv_proj).__name__, "down": type(layer.mlp.down_proj).__name__,
        "head": type(head).__name__ if head is not None else "dense",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("qtype", "mode", "kinds"),
    [
        (Q.Q4_1, "auto", {"qkv": "Int4Linear", "down": "Int4Linear", "head": "Int4Linear"}),
        (Q.Q4_0, "gguf", {"qkv": "Int4Linear", "down": "Int4Linear", "head": "Int4Linear"}),
        (Q.Q8_0, "auto", {"qkv": "Int8Linear", "down": "Int8Linear", "head": "Int8Linear"}),
        (Q.F32, "auto", {"qkv": "Linear", "down": "Linear", "head": "dense"}),
        (Q.F32, "int4", {"qkv": "Int4Linear", "down": "Int4Linear", "head": "Int4Linear"}),
        (Q.Q4_1, "int8", {"qkv": "Int8Linear", "down": "Int8Linear", "head": "Int8Linear"}),
        (Q.Q4_1, "none", {"qkv": "Linear", "down": "Linear", "head": "dense"}),
    ],
)
def test_each_mode_chooses_its_layers(tmp_path: Path, qtype: Q, mode: str, kinds: dict[str, str]) -> None:
    written = write_tiny_llama(tmp_path / "m.gguf", qtype)
    loaded = load_model(EngineConfig(model=str(written.path), num_kv_blocks=8, quantization=mode))
    assert _kinds(loaded.model) == kinds


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_quantized_model_follows_the_dense_one(tmp_path: Path, qtype: Q) -> None:
    """Int4 layers hold the file's own codes (q/k rows unpermuted like the dense weights), so the
    logits follow the dequantized (exact) model's within bfloat16 rounding."""
    written = write_tiny_llama(tmp_path / "m.gguf", qtype, tied=False)
    sources = GGUFSources()
    file = GGUFFile(written.path)
    for tensor in file.tensors():
        sources.add(str(hf_tensor_name(tensor.name)), tensor, 4 if ".attn_q." in tensor.name else
                    2 if ".attn_k." in tensor.name else 0)  # fmt: skip
    for name, groups in sources.int4.items():
        np.testing.assert_array_equal(groups.dequantize(), written.weights[name], err_msg=name)
    dense = load_model(EngineConfig(model=str(written.path), num_kv_blocks=8, quantization="none")).model
    packed = load_model(EngineConfig(model=str(written.path), num_kv_blocks=8, quantization="gguf")).model
    ids = torch.tensor([5, 9, 40, 41, 200, 7])
    with torch.inference_mode():
        ctx = ForwardContext(None, [], None)
        expected = dense.compute_logits(dense(ids, torch.arange(6), ctx))
        actual = packed.compute_logits(packed(ids, torch.arange(6), ctx))
    _close(actual, expected, 0.05)


def test_quantized_modes_are_refused_where_the_kernels_do_not_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CPU"):
        EngineConfig(model="tiny", device="cuda", quantization="int8")
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(model="tiny", quantization="int4", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="GGUF"):
        load_model(EngineConfig(model="tiny", quantization="gguf"))
    with pytest.raises(ConfigError):
        EngineConfig(model="tiny", quantization="int3")
    # auto stays dense where the quantized kernels do not apply (several ranks, or not a GGUF)
    written = write_tiny_llama(tmp_path / "m.gguf", Q.Q4_1)
    two_ranks = EngineConfig(model=str(written.path), num_kv_blocks=8, tensor_parallel_size=2)
    assert load_model(two_ranks).model.head is None
    assert load_model(EngineConfig(model="tiny", num_kv_blocks=8)).model.head is None


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_prompt_rows_use_the_dense_copy_and_decode_rows_the_packed_kernel(kind: str) -> None:
    """With a row split, the first rows (decodes) go through the packed kernel, the others through
    the bfloat16 copy of the same weight: each row gives what it gives alone on its path."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    split = RowSplit()
    if kind == "int4":
        layer: Int4Linear | Int8Linear = Int4Linear(quantize_int4(w.numpy()), 96, 64, split=split, dense=True)
    else:
        layer = Int8Linear(w, split=split, dense=True)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(6))
    packed = layer(x)  # packed_rows None: every row packed
    split.packed_rows = 0
    dense = layer(x)
    _close(dense, packed, 0.02)  # the same weight (bf16-rounded), another kernel
    split.packed_rows = 3
    mixed = layer(x)
    assert torch.equal(mixed[:3], packed[:3]) and torch.equal(mixed[3:], dense[3:])
    split.packed_rows = 1
    assert torch.equal(layer(x[4:6]), torch.cat((packed[4:5], dense[5:6])))
