import subprocess
import sys

import pytest

from kvwire.cli import BENCHMARKS, COMMANDS, build_parser


def test_every_subcommand_is_listed_in_help() -> None:
    help_text = build_parser(["--help"]).format_help()
    for name in [*COMMANDS, "bench"]:
        assert name in help_text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_subcommand_module_exposes_entry_points(name: str) -> None:
    import importlib

    module = importlib.import_module(COMMANDS[name][0])
    assert callable(module.add_arguments) and callable(module.run)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_module_exposes_entry_points(name: str) -> None:
    import importlib

    module = importlib.import_module(BENCHMARKS[name][0])
    assert callable(module.add_arguments) and callable(module.run)


def test_router_cli_does_not_import_torch() -> None:
    code = (
        "import sys; from kvwire.cli import build_parser; build_parser(['router', '--help'][:1]);"
        "assert 'torch' not in sys.modules, 'router CLI imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_up_cli_does_not_import_torch() -> None:
    # `kvwire up` only starts processes: it must stay light (torch is ~2 s and ~200 MB to import)
    code = (
        "import sys; import kvwire.cluster.cli, kvwire.cluster.local;"
        "assert 'torch' not in sys.modules, 'kvwire up imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
