"""``kvwire bench fuzz``: every decoder a peer or client reaches, fuzzed with atheris (decision 113).

One atheris process per target (:mod:`kvwire.bench.fuzz_worker`; libFuzzer runs once per process),
one after the other, each with the target's seed corpus (real messages from the real encoders,
:mod:`kvwire.bench.fuzz_corpus`). Prints per target: inputs tried, crashes (inputs that raised an
exception the decoder's contract does not allow), inputs/s (from the first input, start-up
excluded). The goal (issue 33): at least 1,000,000 inputs per target and no crash. Exit status 1 when
any target crashed or its worker failed. Crashing inputs are kept under ``--out`` to reproduce.

Example: ``nice kvwire bench fuzz --inputs 1000000 --json``. atheris is a ``dev`` extra
(``pip install 'kvwire[dev]'``), not a dependency of kvwire: without it the command says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from kvwire.bench.fuzz_targets import TARGETS

_EXECUTED = re.compile(rb"stat::number_of_executed_units:\s*(\d+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--targets", default="all",
                        help=f"comma-separated targets or 'all' ({', '.join(TARGETS)}); "
                        "module:function builds a target of your own")
    parser.add_argument("--inputs", type=int, default=0, help="inputs per target (default 100000 "
                        "unless --seconds is given)")
    parser.add_argument("--seconds", type=float, default=0.0, help="time per target instead of --inputs")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer seed (same seed, same run)")
    parser.add_argument("--out", default=None, help="keep each target's crashes and grown corpus here "
                        "(default: a temporary directory, kept only when something crashed)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


@dataclasses.dataclass
class TargetResult:
    target: str
    inputs: int = 0
    crashes: int = 0
    inputs_per_s: float = 0.0
    wall_s: float = 0.0
    error: str = ""  # the worker died or printed no final stats
    crash_kinds: list[str] = dataclasses.field(default_factory=list)


def _rate(progress: pathlib.Path) -> tuple[int, float]:
    """(inputs, seconds) of the last progress line (0, 0 when none was written)."""
    lines = progress.read_text().split() if progress.exists() else []
    return (int(lines[-2]), float(lines[-1])) if len(lines) >= 2 else (0, 0.0)


def fuzz_target(name: str, out: pathlib.Path, inputs: int, seconds: float, seed: int) -> TargetResult:
    """Run one target's worker to the end; its result (crash files are left under ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "kvwire.bench.fuzz_worker", name, "--out", str(out), "--seed", str(seed),
           "--runs", str(inputs), "--seconds", str(seconds)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    result = TargetResult(name, wall_s=time.perf_counter() - t0)
    (out / "libfuzzer.log").write_bytes(proc.stderr)
    executed = _EXECUTED.search(proc.stderr)
    if executed is None or proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
        result.error = f"worker exit status {proc.returncode}: {' | '.join(tail)}"
    result.inputs = int(executed.group(1)) if executed else 0
    crashes = (out / "crashes.txt").read_text().splitlines() if (out / "crashes.txt").exists() else []
    result.crashes = len(crashes)
    result.crash_kinds = sorted({line.split(":", 1)[0] for line in crashes})
    done, spent_s = _rate(out / "progress.txt")
    result.inputs_per_s = done / spent_s if spent_s > 0 else 0.0
    return result


def _targets(spec: str) -> list[str]:
    names = list(TARGETS) if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS and ":" not in n]
    if unknown or not names:
        raise SystemExit(f"kvwire bench fuzz: unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    return names


def _print_table(results: list[TargetResult], out: pathlib.Path) -> None:
    print(f"{'target':<22} {'inputs':>10} {'crashes':>8} {'inputs/s':>10} {'wall s':>8}")
    for r in results:
        kinds = f"  ({', '.join(r.crash_kinds)})" if r.crash_kinds else ""
        error = f"  ERROR {r.error}" if r.error else ""
        row = f"{r.target:<22} {r.inputs:>10,} {r.crashes:>8} {r.inputs_per_s:>10,.0f} {r.wall_s:>8.1f}"
        print(row + kinds + error)
    if any(r.crashes or r.error for r in results):
        print(f"crashing inputs and libFuzzer logs: {out}/<target>/")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("atheris") is None:
        print("kvwire bench fuzz needs atheris, which is not installed: pip install atheris "
              "(or the dev extra: pip install 'kvwire[dev]')", file=sys.stderr)
        return 2
    names = _targets(args.targets)
    inputs = args.inputs if args.inputs > 0 or args.seconds > 0 else 100_000
    out = pathlib.Path(args.out) if args.out else pathlib.Path(tempfile.mkdtemp(prefix="kvwire-fuzz-"))
    results = []
    for name in names:
        results.append(fuzz_target(name, out / name, inputs, args.seconds, args.seed))
        if not args.json:
            print(f"  {name}: {results[-1].inputs:,} inputs, {results[-1].crashes} crashes", file=sys.stderr)
    if args.json:
        print(json.dumps({"out": str(out), "targets": [dataclasses.asdict(r) for r in results]}, indent=2))
    else:
        _print_table(results, out)
    failed = any(r.crashes or r.error for r in results)
    if not failed and not args.out:
        _remove(out)
    return 1 if failed else 0


def _remove(path: pathlib.Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
