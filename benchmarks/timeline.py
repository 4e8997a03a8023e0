"""Print both ranks' GPU work of traced transfers on one time axis (from ``--profile DIR`` traces).

    python benchmarks/timeline.py DIR [--label c-512] [--iteration -1] [--api]

``kvwire bench transfer --backend nccl --profile DIR`` and ``benchmarks/graph_probe.py --profile DIR``
trace a few untimed iterations per size into one Chrome trace per rank (``LABEL-r0.json``,
``LABEL-r1.json``; torch profiler with CUPTI) and write rank 0's host-measured time of each
(``LABEL-host.json``). Both ranks run on one host, so their timestamps share a clock.

An iteration starts at the sender's first GPU event after the host's ``t0`` marker (an armed
transfer's first work once its signal fired) or, without markers, at its kernel (the ceiling's
send); it ends with the receiver's last GPU event before a pause (the next iteration's work).

Per iteration: the host-measured time, the GPU span, how long before the GPU start the host's
``t0`` marker began, and how long after the GPU end the receiver's host noticed (``end`` marker).
Then every GPU event of one iteration (``--iteration``, default the last): rank, stream, start and
end (us after the start), duration, short name; ``--api`` adds the host's CUDA runtime/driver calls
longer than 5 us.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
from collections.abc import Sequence

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
API_CATEGORIES = {"cuda_runtime", "cuda_driver"}
MARKERS = {"t0", "end"}
IDLE_US = 300.0  # a pause this long on the receiver's GPU ends a transfer


@dataclasses.dataclass(frozen=True)
class Event:
    rank: int
    stream: str
    name: str
    start: float  # us, absolute
    dur: float
    category: str

    @property
    def end(self) -> float:
        return self.start + self.dur

    @property
    def on_gpu(self) -> bool:
        return self.category in GPU_CATEGORIES


def short_name(name: str) -> str:
    if name.startswith(("ncclDevKernel", "ncclKernel")):
        return "nccl:" + name.split("_", 1)[-1][:24]
    if name.startswith(("Memcpy", "Memset")):
        return name
    match = re.search(r"(gather|scatter|paged\w*|copy\w*|fill\w*|elementwise\w*)", name)
    return (match.group(1) if match else name)[:40]


def load(path: str, rank: int) -> list[Event]:
    with open(path) as fh:
        trace = json.load(fh)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000.0
    events = []
    for raw in trace.get("traceEvents", []):
        category = raw.get("cat", "")
        wanted = category in GPU_CATEGORIES | API_CATEGORIES or raw.get("name") in MARKERS
        if raw.get("ph") != "X" or not wanted:
            continue
        stream = str(raw.get("args", {}).get("stream", raw.get("tid", "")))
        events.append(Event(rank, stream, raw["name"], raw["ts"] + base_us, raw.get("dur", 0.0), category))
    return sorted(events, key=lambda e: e.start)


def origins(events: Sequence[Event]) -> list[float]:
    """Each iteration's start on the sender's GPU: its first GPU event after each host ``t0`` marker
    (an armed transfer's first work once its signal fired), else each of its kernels (the ceiling)."""
    sender = [e for e in events if e.rank == 0 and e.on_gpu]
    marks = [e.start for e in events if e.rank == 0 and e.name == "t0" and not e.on_gpu]
    if marks:
        firsts = [min((e.start for e in sender if e.start >= mark), default=None) for mark in marks]
        return sorted({start for start in firsts if start is not None})
    return [e.start for e in sender if e.category == "kernel"]


def _transfer_end(events: Sequence[Event], t0: float, t1: float) -> float:
    """The receiver's last GPU event of the transfer started at ``t0``: events ending after ``t0``
    up to the first pause of more than ``IDLE_US`` (later ones, e.g. the next transfer's gate arms,
    belong to the next iteration)."""
    end = t0
    for event in sorted(
        (e for e in events if e.rank == 1 and e.on_gpu and t0 <= e.end < t1), key=lambda e: e.end
    ):
        if event.start - end > IDLE_US and event.start > t0:
            break
        end = max(end, event.end)
    return end


def report(label: str, events: list[Event], host_us: list[float], iteration: int, api: bool) -> None:
    starts = origins(events)
    bounds = [*starts, float("inf")]
    print(f"\n== {label}: {len(starts)} iterations (us)")
    print(f"{'iter':>4} {'host':>8} {'gpu span':>9} {'t0 lead':>8} {'end lag':>8}")
    spans = []
    for i, (t0, t1) in enumerate(itertools.pairwise(bounds)):
        end = _transfer_end(events, t0, t1)
        spans.append((t0, end))
        lead = [t0 - e.start for e in events if e.name == "t0" and e.rank == 0 and t0 - 2000 <= e.start <= t0]
        lag = [e.start - end for e in events if e.name == "end" and e.rank == 1 and end <= e.start < t1]
        host = host_us[i] if i < len(host_us) else float("nan")
        lead_s = f"{min(lead):8.1f}" if lead else f"{'-':>8}"
        lag_s = f"{min(lag):8.1f}" if lag else f"{'-':>8}"
        print(f"{i:>4} {host:>8.1f} {end - t0:>9.1f} {lead_s} {lag_s}")
    if not spans:
        return
    t0, end = spans[iteration]
    t1 = bounds[bounds.index(t0) + 1]
    rows = [e for e in events if e.on_gpu and t0 <= e.end < t1 and e.end <= end + 1]
    if api:
        rows += [
            e for e in events if e.category in API_CATEGORIES and e.dur > 5 and t0 - 500 <= e.start <= end
        ]
    rows.sort(key=lambda e: e.start)
    print(f"iteration {iteration}: {end - t0:.1f} us on the GPU")
    print(f"{'rank':>4} {'stream':>8} {'start':>9} {'end':>9} {'dur':>8}  name")
    for e in rows:
        where = "" if e.on_gpu else "  (host)"
        print(
            f"{e.rank:>4} {e.stream[-8:]:>8} {e.start - t0:>9.1f} {e.end - t0:>9.1f} {e.dur:>8.1f}  "
            f"{short_name(e.name)}{where}"
        )
    recv = [e for e in rows if e.rank == 1 and e.name.startswith("nccl")]
    gaps = [b.start - a.end for a, b in itertools.pairwise(recv) if b.start > a.end]
    busy = [
        sum(e.dur for e in rows if e.rank == r and e.on_gpu and not e.name.startswith("nccl")) for r in (0, 1)
    ]
    print(
        f"   receiver NCCL kernels: {len(recv)}, gaps between them {sum(gaps):.1f} us; "
        f"non-NCCL GPU time: sender {busy[0]:.1f} us, receiver {busy[1]:.1f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--label", action="append", default=[], help="only these labels (default: all)")
    parser.add_argument("--iteration", type=int, default=-1, help="the iteration to list (default: last)")
    parser.add_argument("--api", action="store_true", help="also list host CUDA API calls > 5 us")
    args = parser.parse_args()
    names = os.listdir(args.directory)
    labels = sorted({name[: -len("-r0.json")] for name in names if name.endswith("-r0.json")})
    for label in labels:
        if args.label and label not in args.label:
            continue
        pair = [os.path.join(args.directory, f"{label}-r{rank}.json") for rank in (0, 1)]
        if not all(os.path.exists(path) for path in pair):
            continue
        host_path = os.path.join(args.directory, f"{label}-host.json")
        host_us: list[float] = []
        if os.path.exists(host_path):
            with open(host_path) as fh:
                host_us = json.load(fh)
        report(label, load(pair[0], 0) + load(pair[1], 1), host_us, args.iteration, args.api)


if __name__ == "__main__":
    main()
