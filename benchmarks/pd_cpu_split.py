"""CPU time per request of each process and thread of a 1P1D cluster against a colocated one, under
``kvwire bench serve``'s load (issue 36: what 1P1D does beyond colocated on a small box).

Each setup is started as ``kvwire bench serve`` starts it (``LocalCluster``, model ``tiny``, push),
with ``benchmarks/pd_cpu_split_site`` first on the children's ``PYTHONPATH`` (it gives each OS
thread its Python thread's name). After the warm-up the driver reads every thread's on-CPU time
(``/proc/<pid>/task/<tid>/schedstat``, nanoseconds) of the router, the instances and this process
(the client), sends the timed load, reads them again, and prints the CPU milliseconds per request
by process and by thread name (digits and ids folded), setups alternating between rounds, with the
client's TTFT p50 beside them. CPU time, unlike wall time, holds up when other work shares the box.
Usage::

    PYTHONPATH=src python benchmarks/pd_cpu_split.py --rounds 2 [--messages]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from kvwire.bench.serve import SETUPS, make_load, run_load
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.protocol.kv_params import TransferMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_step_spans import site_environment

SITE = Path(__file__).resolve().parent / "pd_cpu_split_site"
Clocks = dict[tuple[str, str], int]  # (process, thread name) -> on-CPU ns


def _session_pids(leader: int) -> list[int]:
    """``leader`` and every process of its session (``LocalCluster`` starts each in its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) == leader:
                pids.append(int(entry))
    return pids or [leader]


def _fold(name: str) -> str:
    return re.sub(r"[-_ ]?[0-9a-f]{4,}|\d+", "#", name.strip()) or "?"


def read_clocks(processes: dict[str, list[int]]) -> Clocks:
    clocks: Clocks = defaultdict(int)
    for role, pids in processes.items():
        for pid in pids:
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError, ValueError):
                        base = f"/proc/{pid}/task/{tid}"
                        name = _fold(Path(f"{base}/comm").read_text())
                        clocks[(role, name)] += int(Path(f"{base}/schedstat").read_text().split()[0])
    return clocks


def _site_env(messages: Path | None) -> dict[str, str]:
    env = {"PD_CPU_SPLIT": "1"}
    if messages is not None:
        env["PD_CPU_SPLIT_MESSAGES"] = str(messages)
    return env


def run_setup(name: str, args: argparse.Namespace, log: Path) -> tuple[Clocks, float]:
    """CPU ns per (process, thread) over the timed load, and the client's TTFT p50 (ms). With
    ``--messages`` the transfer agents' control messages are counted by type (the whole run, warm-up
    included) and printed per request."""
    num_p, num_d, num_both = SETUPS[name]
    spec = ClusterSpec(num_prefill=num_p, num_decode=num_d, num_both=num_both, model="tiny",
                       mode=TransferMode.PUSH, port=0, start_timeout_s=600.0)
    load = make_load(args)
    counted = log.parent / f"{name}-messages" if args.messages else None
    if counted is not None:
        counted.mkdir(exist_ok=True)
    roles: dict[int, str] = {}
    env = _site_env(counted)
    with site_environment(SITE, env), log.open("w") as sink, LocalCluster(spec, sink=sink) as cluster:
        assert cluster.router is not None
        processes = {"router": _session_pids(cluster.router.pid), "client": [os.getpid()]}
        for inst in cluster.instances.values():
            processes[inst.role.value if num_p else "colocated"] = _session_pids(inst.process.pid)
            roles[inst.process.pid] = inst.role.value if num_p else "colocated"
        marks: dict[str, Clocks] = {}

        def mark() -> None:
            marks["start"] = read_clocks(processes)

        results, _ = asyncio.run(run_load(cluster.router_url, load, progress=False, after_warmup=mark))
        end = read_clocks(processes)
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} requests failed")
    if counted is not None:
        print_messages(counted, roles, len(load.prompts) + len(load.warmup_prompts))
    delta = {key: end[key] - marks["start"].get(key, 0) for key in end}
    ttft = statistics.median(r.ttft_s for r in results if r.ttft_s is not None) * 1e3
    return delta, ttft


def print_messages(folder: Path, roles: dict[int, str], requests: int) -> None:
    for pid, role in sorted(roles.items()):
        path = folder / f"messages-{pid}.json"
        if not path.exists():
            print(f"    {role}: no message counts (the process did not exit through atexit)")
            continue
        counts = json.loads(path.read_text())
        cells = ", ".join(f"{kind} {n / requests:.2f}" for kind, n in sorted(counts.items()))
        print(f"    {role} control messages per request: {cells}")


def print_round(name: str, delta: Clocks, ttft_ms: float, requests: int, top: int) -> None:
    per_process: dict[str, int] = defaultdict(int)
    for (role, _), ns in delta.items():
        per_process[role] += ns
    total = sum(per_process.values())
    cells = ", ".join(f"{role} {ns / requests / 1e6:.2f}" for role, ns in sorted(per_process.items()))
    print(f"{name}: TTFT p50 {ttft_ms:.2f} ms; CPU ms/request: {cells}; all {total / requests / 1e6:.2f}")
    for (role, thread), ns in sorted(delta.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {role:>9} {thread:<16} {ns / requests / 1e6:7.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--setups", default="1p1d,colocated")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--top", type=int, default=14, help="threads listed per setup and round")
    parser.add_argument("--messages", action="store_true",
                        help="also count the transfer agents' control messages by type")
    args = parser.parse_args()
    args.seed, args.arrival, args.warmup, args.model = 0, "poisson", 2, "tiny"
    args.max_concurrency, args.timeout_s = 0, 120.0
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            load = os.getloadavg()[0]
            print(f"round {index + 1} (load average {load:.2f})")
            for name in names if index % 2 == 0 else names[::-1]:
                delta, ttft = run_setup(name, args, Path(tmp) / f"{name}.log")
                print_round(name, delta, ttft, args.num_prompts, args.top)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
