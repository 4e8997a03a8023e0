"""TransferConfig and LayerSpec validation."""

from __future__ import annotations

import pytest
import torch

from kvwire.errors import ConfigError
from kvwire.transfer import Backend, LayerSpec, TransferConfig


@pytest.mark.parametrize(
    "kw",
    [
        {"control_port": 70000},
        {"recv_budget_bytes": 0},
        {"spill_budget_bytes": -1},
        {"default_deadline_s": 0},
        {"secret": b""},
        {"device": "tpu"},
        {"backend": Backend.NCCL},  # NCCL needs CUDA
        {"backend": "carrier-pigeon"},
        {"host": ""},
    ],
)
def test_bad_config_raises(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TransferConfig(**kw)  # type: ignore[arg-type]


def test_config_normalizes_secret_and_backend() -> None:
    cfg = TransferConfig(secret="abc", backend="tcp")  # type: ignore[arg-type]
    assert cfg.secret == b"abc" and cfg.backend is Backend.TCP


def test_layer_spec() -> None:
    assert LayerSpec((2, 16, 8, 128), torch.bfloat16).num_bytes == 2 * 16 * 8 * 128 * 2
    assert LayerSpec.of(torch.zeros(3, 4, dtype=torch.float32)) == LayerSpec((3, 4), torch.float32)
    with pytest.raises(ConfigError):
        LayerSpec((2, -1), torch.float32)
    with pytest.raises(ConfigError):
        LayerSpec((2,), torch.complex64)
