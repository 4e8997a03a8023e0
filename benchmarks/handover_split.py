"""Where a 1P1D handover goes (decision 162): P's forward end -> D's engine step has the KV, split.

Runs ``kvwire bench serve --setups 1p1d`` (the load of issue 36's runs by default) with every
instance loading ``benchmarks/handover_split_site/sitecustomize.py``, which writes a wall-clock
mark at the calls along the handover (nothing in ``src/``). Per request, from D's record of the
handover (P's ``kv_ready_unix_s`` and the landing time, from the trailer), it takes the first mark
of each point after the one before and prints p50/p99 of each segment (ms). Both ends are
``time.time()`` on one host. Run from a worktree root:

    PYTHONPATH=src python benchmarks/handover_split.py
    PYTHONPATH=src python benchmarks/handover_split.py --dir /tmp/run   # logs kept from a run
"""

from __future__ import annotations

import argparse
import bisect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SITE = Path(__file__).resolve().parent / "handover_split_site"

# (label, role, mark); each searched after the previous point's time
POINTS = [
    ("P's forward and sampling return", "prefill", "ModelRunner._forward_and_sample out"),
    ("P's engine step returns", "prefill", "LLMEngine.step out"),
    ("P's outputs posted (loop step returns)", "prefill", "kvwire-engine EngineLoop._step out"),
    ("P's event loop delivers the outputs", "prefill", "EngineLoop._deliver in"),
    ("P's loop woken (outputs written)", "prefill", "EngineLoop.wake in"),
    ("P's next step starts", "prefill", "kvwire-engine EngineLoop._step in"),
    ("P hands the held layers (send_saved in)", "prefill", "_SendSide.send_saved in"),
    ("start_send returns (Offer queued)", "prefill", "_SendSide._start_agent_send out"),
    ("send_saved returns (layers queued)", "prefill", "_SendSide.send_saved out"),
    ("P's shm writer starts copying", "prefill", "Outbound._write_direct in"),
    ("P's shm writer done (DONE frames sent)", "prefill", "Outbound._write_direct out"),
    ("D's shm reader sees the first DONE", "decode", "Inbound._written in"),
    ("D records the transfer complete", "decode", "CompletionEvents.recvd in"),
    ("D's loop woken", "decode", "EngineLoop.wake in"),
    ("D's engine step has it (to_step)", "decode", "exposed in"),
]


def run(out_dir: Path, bench_args: list[str]) -> None:
    env = dict(os.environ, HANDOVER_SPLIT_DIR=str(out_dir))
    paths = filter(None, env.get("PYTHONPATH", "").split(os.pathsep))
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *paths])
    cmd = [sys.executable, "-c", "import sys; from kvwire.cli import main; sys.exit(main())",
           "bench", "serve", "--setups", "1p1d", *bench_args]
    with open(out_dir / "bench.txt", "w") as out:
        subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=600)


def load(out_dir: Path) -> dict[str, list[tuple[float, str]]]:
    marks: dict[str, list[tuple[float, str]]] = {"prefill": [], "decode": []}
    for path in out_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[1] in marks:
                marks[parts[1]].append((float(parts[0]), parts[2]))
    for values in marks.values():
        values.sort()
    return marks


def first_after(marks: list[tuple[float, str]], times: list[float], t: float, text: str) -> float | None:
    for i in range(bisect.bisect_left(times, t), len(marks)):
        if text in marks[i][1]:
            return marks[i][0]
    return None


def split(marks: dict[str, list[tuple[float, str]]]) -> tuple[list[str], list[list[float]], int]:
    times = {role: [m[0] for m in values] for role, values in marks.items()}
    labels = ["P's forward end (kv_ready)"] + [p[0] for p in POINTS] + ["D holds every layer (landed)"]
    rows: list[list[float]] = []
    for t, text in marks["decode"]:
        if not text.startswith("kvwire-engine exposed in"):
            continue
        ready, landed = (float(v) for v in text.split()[-2:])
        row, at = [ready], ready
        for _, role, mark in POINTS:
            found = first_after(marks[role], times[role], at, mark)
            if found is None or found > t + 1e-6:
                break
            row.append(found)
            at = found
        if len(row) == len(POINTS) + 1:
            rows.append([*row, landed])
    grants = sum(1 for _, text in marks["decode"] if text.endswith("_send_now in Grant"))
    return labels, rows, grants


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(marks: dict[str, list[tuple[float, str]]]) -> None:
    labels, rows, grants = split(marks)
    print(f"requests split: {len(rows)}; Grants sent by D: {grants}")
    if not rows:
        return
    print("| segment (ends at) | p50 ms | p99 ms |\n|---|---|---|")
    for i in range(1, len(labels) - 1):
        gaps = [(r[i] - r[i - 1]) * 1e3 for r in rows]
        print(f"| {labels[i - 1]} -> {labels[i]} | {pct(gaps, 0.5):.3f} | {pct(gaps, 0.99):.3f} |")
    for name, index in (("handover (-> landed)", -1), ("to_step", -2)):
        totals = [(r[index] - r[0]) * 1e3 for r in rows]
        print(f"| total: {name} | {pct(totals, 0.5):.3f} | {pct(totals, 0.99):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="read the logs of an earlier run here")
    parser.add_argument("bench_args", nargs="*", default=["--input-len", "128", "--request-rate", "4",
                                                          "--num-prompts", "48", "--json"])
    args = parser.parse_args()
    out_dir = args.dir
    if out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="handover-split-"))
        run(out_dir, args.bench_args)
        print(f"logs: {out_dir}")
    report(load(out_dir))


if __name__ == "__main__":
    main()
