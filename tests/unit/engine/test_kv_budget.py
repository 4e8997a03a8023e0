"""How much GPU memory the KV cache may take (model_runner.cuda_kv_budget): pure arithmetic on the
numbers torch.cuda.mem_get_info and memory_reserved give, so it runs on the CPU."""

from __future__ import annotations

import argparse

import pytest

from kvwire.engine.config import EngineConfig
from kvwire.engine.model_runner import cuda_kv_budget
from kvwire.errors import ConfigError
from kvwire.server.cli import add_arguments, engine_config_from_args

GIB = 1 << 30


def test_without_a_share_the_cache_takes_a_fraction_of_what_is_free() -> None:
    config = EngineConfig(device="cuda")
    assert cuda_kv_budget(config, 60 * GIB, 80 * GIB, 16 * GIB) == pytest.approx(0.8 * 60 * GIB)


def test_a_share_caps_the_cache_at_what_the_weights_leave_of_it() -> None:
    """P first on an 80 GiB GPU with 0.45 of it: 36 GiB less its 16 GiB of weights, not 0.8 of the
    62 GiB free (which left D 12 GiB for 16 GiB of weights)."""
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.45)
    assert cuda_kv_budget(config, 62 * GIB, 80 * GIB, 16 * GIB) == pytest.approx(0.8 * (0.45 * 80 - 16) * GIB)
    # what is free still caps it when others took more than their share
    assert cuda_kv_budget(config, 10 * GIB, 80 * GIB, 16 * GIB) == pytest.approx(0.8 * 10 * GIB)


def test_weights_that_fill_the_share_are_a_clear_error() -> None:
    config = EngineConfig(device="cuda:1", gpu_memory_utilization=0.1)
    message = r"gives this instance 8.0 GiB of cuda:1's 80.0 GiB.*holds 16.0 GiB"
    with pytest.raises(ConfigError, match=message):
        cuda_kv_budget(config, 60 * GIB, 80 * GIB, 16 * GIB)


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_a_share_outside_0_1_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        EngineConfig(device="cuda", gpu_memory_utilization=value)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_takes_vllms_flag() -> None:
    given = engine_config_from_args(_serve_args("--gpu-memory-utilization", "0.45"))
    assert given.gpu_memory_utilization == 0.45
    assert engine_config_from_args(_serve_args()).gpu_memory_utilization is None
