"""One fuzz target under atheris, in a process of its own (``kvwire bench fuzz`` starts one per target).

atheris (libFuzzer) runs once per process: :func:`atheris.Fuzz` ends the process when its runs are
done, so the parent reads the outcome from libFuzzer's final stats (stderr) and from the files this
worker writes under ``--out``: ``progress.txt`` (inputs done and seconds since the first input,
every :data:`PROGRESS_EVERY` inputs: the throughput without the start-up), ``crashes.txt`` (one
line per uncaught exception: its type and message) and the first :data:`KEEP_CRASHES` crashing
inputs (``crash-N.bin``, to reproduce and to turn into regression tests). A crash does not stop the
run (it is counted and fuzzing goes on), so the count is of all inputs that crashed. The decoders
are instrumented for coverage (atheris' import hook on ``kvwire``); mutations are libFuzzer's, mixed
with the structure-aware ones of :mod:`kvwire.bench.fuzz_mutate`.

Usage: ``python -m kvwire.bench.fuzz_worker TARGET --out DIR [--runs N | --seconds S] [--seed K]``.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import random
import sys
import time
from collections.abc import Sequence

KEEP_CRASHES = 20
PROGRESS_EVERY = 10_000  # inputs between two lines of progress.txt (inputs, seconds since the first)
STRUCTURED_SHARE = 0.25  # of mutations: structure-aware (the rest: libFuzzer's byte mutations)


def _args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvwire.bench.fuzz_worker")
    parser.add_argument("target")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--runs", type=int, default=0, help="inputs to try (0: until --seconds)")
    parser.add_argument("--seconds", type=float, default=0.0, help="time budget (0: until --runs)")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def _libfuzzer_argv(args: argparse.Namespace, max_len: int, corpus: pathlib.Path) -> list[str]:
    argv = [sys.argv[0], f"-seed={args.seed}", f"-max_len={max_len}", "-print_final_stats=1",
            "-timeout=30", "-rss_limit_mb=4096", "-len_control=0"]
    if args.runs > 0:
        argv.append(f"-runs={args.runs}")
    if args.seconds > 0:
        argv.append(f"-max_total_time={max(1, round(args.seconds))}")
    return [*argv, str(corpus)]


def main(argv: Sequence[str] | None = None) -> None:
    import atheris

    from kvwire.bench.fuzz_mutate import mutate
    from kvwire.bench.fuzz_targets import build

    args = _args(sys.argv[1:] if argv is None else argv)
    logging.disable(logging.CRITICAL)  # what decoders log about bad input, a million times over
    with atheris.instrument_imports(include=["kvwire"]):
        target = build(args.target)
    seeds = target.seeds()
    corpus = args.out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)
    log = (args.out / "crashes.txt").open("a", encoding="utf-8")
    progress = (args.out / "progress.txt").open("a", encoding="utf-8")
    kept = done = 0
    started = 0.0

    def one_input(data: bytes) -> None:
        nonlocal kept, done, started
        if done % PROGRESS_EVERY == 0 or done & (done - 1) == 0:  # also at powers of two: short runs
            now = time.perf_counter()
            started = started or now
            progress.write(f"{done} {now - started:.6f}\n")
            progress.flush()
        done += 1
        exc = target.crash_of(data)
        if exc is None:
            return
        log.write(f"{type(exc).__name__}: {str(exc)[:200]!r}\n")
        log.flush()
        if kept < KEEP_CRASHES:
            (args.out / f"crash-{kept}.bin").write_bytes(data)
            kept += 1

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < STRUCTURED_SHARE:
            return mutate(rng, data, seeds, max_size)
        out: bytes = atheris.Mutate(data, max_size)
        return out

    atheris.Setup(_libfuzzer_argv(args, target.max_len, corpus), one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
