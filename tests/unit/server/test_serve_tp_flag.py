"""`kvwire serve --tensor-parallel-size/--tp` reaches the engine config; the default stays 1."""

from __future__ import annotations

import argparse

from kvwire.server.cli import add_arguments, engine_config_from_args


def _config(*argv: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_tensor_parallel_size_flag() -> None:
    assert _config().tensor_parallel_size == 1
    assert _config("--tensor-parallel-size", "2").tensor_parallel_size == 2
    assert _config("--tp", "4").tensor_parallel_size == 4
