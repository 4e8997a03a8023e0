"""`kvwire serve --quantization / --cpu-threads / --packed-prompts / --no-cpu-malloc-tuning` reach
the engine config, with their defaults (decisions 118, 119, 152); the thread default follows
OMP_NUM_THREADS, else half the cores."""

from __future__ import annotations

import argparse
import os

import pytest

from kvwire.engine.config import EngineConfig, Quantization
from kvwire.errors import ConfigError
from kvwire.server.cli import add_arguments, engine_config_from_args


def _config(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_defaults_and_flags_reach_the_engine_config() -> None:
    default = _config()
    assert default.quantization is Quantization.AUTO
    assert default.cpu_threads is None and default.dense_prompt_weights and default.cpu_malloc_tuning
    flags = _config("--quantization", "int8", "--cpu-threads", "3", "--packed-prompts",
                    "--no-cpu-malloc-tuning")
    assert flags.quantization is Quantization.INT8
    assert flags.cpu_threads == 3 and not flags.dense_prompt_weights and not flags.cpu_malloc_tuning
    with pytest.raises(SystemExit):
        _config("--quantization", "int2")
    with pytest.raises(ConfigError):
        EngineConfig(cpu_threads=0)


def test_thread_default_is_omp_num_threads_else_half_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig().resolved_cpu_threads() == 3
    assert EngineConfig(cpu_threads=2).resolved_cpu_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert EngineConfig().resolved_cpu_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
