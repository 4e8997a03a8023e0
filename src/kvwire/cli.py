"""``kvwire`` command line: one entry point, one module per subcommand.

Each subcommand lives in the package that owns it and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up (imported lazily so ``kvwire router`` never
imports torch).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# subcommand -> (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvwire.server.cli", "serve one engine behind the OpenAI API (role both|prefill|decode)"),
    "router": ("kvwire.router.cli", "run the OpenAI-compatible router with service discovery"),
    "up": ("kvwire.cluster.cli", "start a local router + prefill/decode cluster as subprocesses"),
    "scale": ("kvwire.cluster.ray_cli", "add or drain instances of a `kvwire up --ray` cluster"),
    "secret": ("kvwire.secrets_config", "print a fresh cluster secret (for KVWIRE_SECRET or --secret-file)"),
    "demo": ("kvwire.cluster.demo", "fresh-machine demo: local 1P1D on CPU, chat questions to smollm2-135m"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "transfer": ("kvwire.bench.transfer", "KV transfer throughput vs the link's ceiling"),
    "router": ("kvwire.bench.router", "router added latency and requests/s against mock upstreams"),
    "serve": ("kvwire.bench.serve", "OpenAI-API load generator: TTFT/ITL/TPOT/E2E percentiles"),
    "engine": ("kvwire.bench.engine", "built-in engine prefill/decode throughput"),
    "discovery": ("kvwire.bench.discovery", "discovery with N simulated instances: router CPU, latencies"),
    "soak": ("kvwire.bench.soak", "cluster under load while instances are killed: failures, hangs, leaks"),
    "fuzz": ("kvwire.bench.fuzz", "every decoder fuzzed with atheris: inputs tried, crashes, inputs/s"),
}


def _add_lazy(sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    parser = sub.add_parser(name, help=help_, description=help_)
    parser.set_defaults(_module=module)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.startswith("kvwire"):
            parser.set_defaults(_missing=f"'{name}' is not available in this build ({exc})")
            return
        raise
    mod.add_arguments(parser)


def _positionals(argv: Sequence[str]) -> list[str]:
    """Non-option words, skipping the value of ``--log-level VALUE`` (the one global option)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwire", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    # Only import the module of the subcommand asked for (so `kvwire router` never imports torch).
    rest = _positionals(argv)
    wanted = rest[0] if rest else None
    for name, (module, help_) in COMMANDS.items():
        if name == wanted:
            _add_lazy(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    bench = sub.add_parser("bench", help="benchmarks that print a table and measure a baseline")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    wanted_bench = rest[1] if len(rest) > 1 and rest[0] == "bench" else None
    for name, (module, help_) in BENCHMARKS.items():
        if name == wanted_bench:
            _add_lazy(bench_sub, name, module, help_)
        else:
            bench_sub.add_parser(name, help=help_)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    missing = getattr(args, "_missing", None)
    if missing:
        print(f"kvwire: {missing}", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    result: int = module.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
