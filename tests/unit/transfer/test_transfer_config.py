"""TransferConfig (validation, per-rank copies, NCCL tuning from the environment) and LayerSpec."""

from __future__ import annotations

import os

import pytest
import torch

from kvwire.errors import ConfigError
from kvwire.transfer import Backend, LayerSpec, TransferConfig
from kvwire.transfer.config import ControlLimits


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


def test_unexpected_offer_bytes_default_to_a_quarter_of_the_receive_budget() -> None:
    assert TransferConfig().unexpected_bytes_per_peer == 256 << 20
    assert TransferConfig(recv_budget_bytes=1000).unexpected_bytes_per_peer == 250
    limits = ControlLimits(max_unexpected_bytes_per_peer=4096)
    assert TransferConfig(limits=limits).unexpected_bytes_per_peer == 4096
    with pytest.raises(ConfigError, match="max_unexpected_bytes_per_peer"):
        ControlLimits(max_unexpected_bytes_per_peer=-1)


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


def test_for_rank_shifts_fixed_ports_and_sets_the_device() -> None:
    """The one rank rule (the vLLM plugin's workers, the built-in engine's TP ranks): fixed ports,
    bound and advertised, become port + rank; 0 (any free / the bound one) stays 0."""
    base = TransferConfig(control_port=7000, data_port=0, advertise_control_port=31000,
                          advertise_data_port=31100, device="cuda", backend=Backend.NCCL, secret=b"s" * 32)
    rank2 = base.for_rank(2, "cuda:2")
    assert (rank2.control_port, rank2.data_port) == (7002, 0)
    assert (rank2.advertise_control_port, rank2.advertise_data_port) == (31002, 31102)
    assert rank2.device == "cuda:2" and rank2.secret == base.secret and rank2.backend is Backend.NCCL
    assert base.for_rank(0, "cuda") == base


def test_nccl_tuning_is_read_from_the_environment_by_the_builders_helper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwire.transfer.config import NcclPlaneConfig, nccl_from_env

    for name in [n for n in os.environ if n.startswith("KVWIRE_NCCL_")]:
        monkeypatch.delenv(name)
    assert nccl_from_env() == NcclPlaneConfig()
    monkeypatch.setenv("KVWIRE_NCCL_LANES", "3")
    monkeypatch.setenv("KVWIRE_NCCL_CHUNK_MIB", "16")
    tuned = nccl_from_env()
    assert (tuned.lanes, tuned.chunk_bytes) == (3, 16 << 20)
