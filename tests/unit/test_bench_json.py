"""Every ``kvwire bench`` subcommand takes ``--json`` (scripts compare runs from its output)."""

from __future__ import annotations

import pytest

from kvwire.cli import BENCHMARKS, build_parser


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_subcommand_takes_json(name: str) -> None:
    argv = ["bench", name, "--json"]
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "_missing", None):
        pytest.skip(args._missing)  # an optional dependency of this benchmark is not installed here
    assert args.json is True
