"""Where a request's time to first token goes, 1P1D against colocated, segment by segment.

Runs ``kvwire bench serve --setups 1p1d,colocated`` (issue 36's light load by default) with every
process loading ``benchmarks/first_token_split_site/sitecustomize.py``, which writes a wall-clock
mark at the calls along the first token's path in the client, the router and the instances (nothing
in ``src/``). For each timed request it takes, from the client's send, the first mark of each point
after the one before (P's points in 1P1D, the colocated instance's otherwise) and prints p50 of each
segment (ms) for both setups side by side, and where D's admission falls in 1P1D. Both ends are
``time.time()`` on one host. Run from a worktree root:

    PYTHONPATH=src python benchmarks/first_token_split.py
    PYTHONPATH=src python benchmarks/first_token_split.py --dir /tmp/run   # logs kept from a run
    PYTHONPATH=src python benchmarks/first_token_split.py --hold-d          # a probe of decision 164

Besides the path, it prints the serving instance's forward split into its thread's CPU time and the
rest (``wall - thread CPU``: the thread waiting for the GIL or preempted), with the thread's voluntary
and involuntary context switches, and which other threads' calls fall inside the forwards.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SITE = Path(__file__).resolve().parent / "first_token_split_site"
SERVING = "serving"  # P in 1P1D, the colocated instance otherwise

# (label, process, mark); each searched after the previous point's time
POINTS = [
    ("router's handler starts", "router", "Dispatcher.dispatch in"),
    ("router picks P and D", "router", "PushPath.pick out"),
    ("router signs P's params", "router", "PdParams.push out"),
    ("router builds P's body", "router", "prefill_body out"),
    # P's call starts before D's params are signed and its body built (decision 167)
    ("router calls the instance", "router", "Relay.call in"),
    ("instance's handler starts", SERVING, "GenerationHandler._handle_one in"),
    ("body read", SERVING, "GenerationHandler.read_body out"),
    ("kv params: start", SERVING, "GenerationHandler._kv_params in"),
    ("kv params: checked", SERVING, "GenerationHandler._kv_params out"),
    ("body parsed and checked", SERVING, "GenerationHandler._prepare out"),
    ("handed to the engine loop", SERVING, "EngineLoop.add_request in"),
    ("engine step starts", SERVING, "LLMEngine.step in"),
    ("forward starts", SERVING, "ModelRunner._forward_and_sample in"),
    ("forward and sampling end", SERVING, "ModelRunner._forward_and_sample out"),
    ("engine step ends", SERVING, "LLMEngine.step out"),
    ("loop step posts outputs", SERVING, "EngineLoop._step out"),
    ("event loop delivers", SERVING, "EngineLoop._deliver in"),
    ("instance writes the token", SERVING, "ClientWriter.* in"),
    ("instance's write returns", SERVING, "ClientWriter.* out"),
    ("router has it", "router", "HAS"),
    ("router decodes P's answer", "router", "FirstTokenSplicer.from_prefill out"),
    ("router opens the client's stream", "router", "Relay.open_stream out"),
    ("router writes to the client", "router", "ClientStream.write in"),
    ("router's write returns", "router", "ClientStream.write out"),
    ("client reads the token", "client", "first in"),
]


def run(out_dir: Path, bench_args: list[str]) -> None:
    env = dict(os.environ, FIRST_TOKEN_SPLIT_DIR=str(out_dir))
    paths = filter(None, env.get("PYTHONPATH", "").split(os.pathsep))
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *paths])
    cmd = [sys.executable, "-c", "import sys; from kvwire.cli import main; sys.exit(main())",
           "bench", "serve", "--setups", "1p1d,colocated", "--no-progress", *bench_args]
    with open(out_dir / "bench.txt", "w") as out:
        subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=900)


def others_in_forwards(out_dir: Path) -> dict[str, dict[str, int]]:
    """Per instance kind (prefill / both): how often each (thread, call in) mark of a thread other
    than the engine thread falls inside one of its forwards."""
    found: dict[str, dict[str, int]] = {}
    for path in out_dir.glob("*.log"):
        kind = path.stem.split("-", 1)[0]
        if kind not in ("prefill", "both"):
            continue
        rows = [line.split(" ", 3) for line in path.read_text().splitlines()]
        windows, start = [], None
        for t, _, _thread, rest in rows:
            if rest == "ModelRunner._forward_and_sample in":
                start = float(t)
            elif rest == "ModelRunner._forward_and_sample out" and start is not None:
                windows.append((start, float(t)))
                start = None
        counts = found.setdefault(kind, {"forwards": len(windows)})
        for t, _, thread, rest in rows:
            if thread == "kvwire-engine" or not rest.endswith(" in") or "usage" in rest:
                continue
            when = float(t)
            i = bisect.bisect_right(windows, (when, float("inf"))) - 1
            if i >= 0 and windows[i][0] <= when <= windows[i][1]:
                key = f"{thread} {rest}"
                counts[key] = counts.get(key, 0) + 1
    return found


def layer_split(out_dir: Path) -> dict[str, dict[str, list[tuple[float, float, int]]]]:
    """With ``--layers``: per instance kind, the prompt forwards' (> 2 ms) pieces between the
    engine thread's CPU marks: (wall ms, off-CPU ms, involuntary switches)."""
    found: dict[str, dict[str, list[tuple[float, float, int]]]] = {}
    for path in out_dir.glob("*.log"):
        kind = path.stem.split("-", 1)[0]
        if kind not in ("prefill", "both"):
            continue
        marks = []
        for line in path.read_text().splitlines():
            t, _, thread, rest = line.split(" ", 3)
            parts = rest.split()
            if thread == "kvwire-engine" and len(parts) == 5 and parts[1] in ("in", "out"):
                marks.append((float(t), f"{parts[0]} {parts[1]}", float(parts[2]), int(parts[3])))
        pieces = found.setdefault(kind, {})
        start = None
        for i, (_, name, _, _) in enumerate(marks):
            if name == "forward-usage in":
                start = i
            elif name == "forward-usage out" and start is not None:
                window, start = marks[start : i + 1], None
                if window[-1][0] - window[0][0] < 0.002:
                    continue
                for (t0, a, cpu0, inv0), (t1, b, cpu1, inv1) in itertools.pairwise(window):
                    off = (t1 - t0) - (cpu1 - cpu0)
                    pieces.setdefault(f"{a} -> {b}", []).append(((t1 - t0) * 1e3, off * 1e3, inv1 - inv0))
    return found


def load(out_dir: Path) -> dict[str, list[tuple[float, str]]]:
    """Marks by process: 'client', 'router' (one per setup, merged), and per instance pid."""
    marks: dict[str, list[tuple[float, str]]] = {}
    for path in out_dir.glob("*.log"):
        role, _ = path.stem.split("-", 1)
        key = role if role in ("client", "router") else path.stem
        rows = marks.setdefault(key, [])
        for line in path.read_text().splitlines():
            t, _, _thread, rest = line.split(" ", 3)
            rows.append((float(t), rest))
    for rows in marks.values():
        rows.sort()
    return marks


def first_after(rows: list[tuple[float, str]], t: float, mark: str, until: float) -> float | None:
    i = bisect.bisect_left(rows, (t, ""))
    prefix, _, phase = mark.partition(".* ")
    for when, text in rows[i:]:
        if when > until:
            return None
        if text == mark or (phase and text.startswith(prefix + ".") and text.endswith(" " + phase)):
            return when
    return None


def split(marks: dict[str, list[tuple[float, str]]]) -> dict[str, dict[str, list[float]]]:
    """Per setup ('1p1d', 'colocated'): label -> segment durations (ms)."""
    client = [t for t, text in marks["client"] if text == "send in"]
    firsts = [t for t, text in marks["client"] if text == "first in"]
    out: dict[str, dict[str, list[float]]] = {}
    instances = {k: v for k, v in marks.items() if k not in ("client", "router")}
    for send, first in zip(client, firsts, strict=False):
        # the serving instance: the prefill or both instance whose handler ran in the window
        serving = None
        for key, rows in instances.items():
            if key.startswith(("prefill", "both")) and first_after(
                    rows, send, "GenerationHandler._handle_one in", first) is not None:
                serving = key
        if serving is None:
            continue
        setup = "1p1d" if serving.startswith("prefill") else "colocated"
        t, labels = send, out.setdefault(setup, {})
        for label, proc, mark in POINTS:
            rows = marks[proc] if proc != SERVING else instances[serving]
            if mark == "HAS":
                mark = "Upstream.read_all out" if setup == "1p1d" else "Relay.relay in"
            when = first_after(rows, t, mark, first + 0.001)
            if when is None:
                continue
            labels.setdefault(label, []).append((when - t) * 1e3)
            t = when
        labels.setdefault("TTFT (client)", []).append((first - send) * 1e3)
        handed = first_after(instances[serving], send, "EngineLoop.add_request in", first)
        admitted = first_after(instances[serving], send, "GenerationHandler._admit out", first)
        usage = [(w, text) for w, text in instances[serving] if text.startswith("forward-usage")
                 and send <= w <= first]
        if len(usage) >= 2 and usage[0][1].startswith("forward-usage in") and usage[1][1].startswith(
                "forward-usage out"):
            (w0, a), (w1, b) = usage[0], usage[1]
            cpu0, sw0, v0 = a.split()[2:5]
            cpu1, sw1, v1 = b.split()[2:5]
            labels.setdefault("forward: voluntary switches", []).append(float(int(v1) - int(v0)))
            off_cpu = (w1 - w0 - float(cpu1) + float(cpu0)) * 1e3
            labels.setdefault("forward: wall - thread CPU", []).append(off_cpu)
            labels.setdefault("forward: thread CPU", []).append((float(cpu1) - float(cpu0)) * 1e3)
            labels.setdefault("forward: involuntary switches", []).append(float(int(sw1) - int(sw0)))
        if handed is not None and admitted is not None:
            labels.setdefault("handler resumes after the hand-over", []).append((admitted - handed) * 1e3)
        if setup == "1p1d":
            for key, rows in instances.items():
                if key.startswith("decode"):
                    for label, mark in (
                        ("D's handler starts (from send)", "GenerationHandler._handle_one in"),
                        ("D admitted (from send)", "GenerationHandler._admit out"),
                    ):
                        when = first_after(rows, send, mark, first)
                        if when is not None:
                            labels.setdefault(label, []).append((when - send) * 1e3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="read the logs of an earlier run here instead of running")
    parser.add_argument("--hold-d", action="store_true", help="probe: the router calls D once P answered")
    parser.add_argument("--defer-control", action="store_true",
                        help="probe: P's control thread handles no message during a forward (at most 20 ms)")
    parser.add_argument("--switch-interval-s", type=float, help="probe: the instances' GIL switch interval")
    parser.add_argument("--slice-ms", type=float, help="probe: the engine threads' scheduler slice")
    parser.add_argument("--layers", action="store_true",
                        help="also mark each decoder layer (CPU time, switches; more overhead)")
    parser.add_argument("bench_args", nargs="*", default=["--input-len", "128", "--request-rate", "4",
                                                          "--num-prompts", "48"])
    args = parser.parse_args()
    probes = {"FIRST_TOKEN_SPLIT_HOLD_D": "1" if args.hold_d else "",
              "FIRST_TOKEN_SPLIT_DEFER": "1" if args.defer_control else "",
              "FIRST_TOKEN_SPLIT_SWITCH_S": str(args.switch_interval_s or ""),
              "FIRST_TOKEN_SPLIT_SLICE_MS": str(args.slice_ms or ""),
              "FIRST_TOKEN_SPLIT_LAYERS": "1" if args.layers else ""}
    os.environ.update(probes)
    if args.dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="first-token-split-"))
        run(out_dir, args.bench_args)
        print(f"logs: {out_dir}")
    else:
        out_dir = args.dir
    result = split(load(out_dir))
    pd, co = result.get("1p1d", {}), result.get("colocated", {})
    print(f"{'segment (ends at), p50 ms':44} {'1P1D':>8} {'colocated':>10}  (n)")
    labels = [label for label, _, _ in POINTS] + ["TTFT (client)", "handler resumes after the hand-over",
                                                  "forward: wall - thread CPU", "forward: thread CPU",
                                                  "forward: involuntary switches",
                                                  "forward: voluntary switches",
                                                  "D's handler starts (from send)",
                                                  "D admitted (from send)"]
    for label in labels:
        a, b = pd.get(label, []), co.get(label, [])
        fa = f"{statistics.median(a):8.3f}" if a else f"{'-':>8}"
        fb = f"{statistics.median(b):10.3f}" if b else f"{'-':>10}"
        print(f"{label:44} {fa} {fb}  ({len(a)}/{len(b)})")
    for kind, pieces in sorted(layer_split(out_dir).items()):
        if pieces:
            print(f"{kind}: prompt forwards by piece (means): wall ms, off-CPU ms, involuntary switches")
        for name, rows in pieces.items():
            n = len(rows)
            wall, off, inv = (sum(r[k] for r in rows) / n for k in range(3))
            print(f"    {name:64} n={n:4} {wall:7.3f} {off:7.3f} {inv:5.2f}")
    for kind, counts in sorted(others_in_forwards(out_dir).items()):
        print(f"{kind}: marks of other threads inside its {counts.pop('forwards')} forwards")
        for key, n in sorted(counts.items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {n:5d}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
