"""``kvwire bench soak``: a P/D cluster under steady load while instances are killed (decision 054).

Scenarios (``--scenario``):

* ``chaos`` (default): ``--prefill`` P + ``--decode`` D (2P2D) on the tiny model, ``--clients``
  closed-loop clients (half streaming) for ``--minutes``; every ``--kill-every-s`` a random instance
  whose role still has another live one is killed with SIGKILL and restarted, so one instance of
  each role is always alive. Baseline in the same run: the first ``--baseline-s`` seconds, no kills.
* ``kill-decode``: 1P2D, one of the two decode instances SIGKILLed a third of the way in (not
  restarted); run twice: with the router's default ``--max-migrations`` and with 0 (no re-dispatch or
  migration: the baseline, the behaviour before decision 052).

Every request has ``ignore_eos`` and a fixed ``max_tokens``; it is **ok** when the whole answer
arrived, **failed (clear)** when it ended in an HTTP error or an in-band error event, **failed
(broken)** when the answer was cut short without an error, **hung** when it did not end within
``--timeout-s``. After the load: **leaked** = ``kvwire_kv_blocks_in_use`` still held on surviving
instances 10 s after the last request; **migrated** = the router's ``kvwire_router_migrations_total``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from typing import Any

import aiohttp

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.cluster.process import wait_until
from kvwire.errors import ClusterError

VOCAB = 250


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=["chaos", "kill-decode"], default="chaos")
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration per run")
    parser.add_argument("--prefill", type=int, default=2, help="chaos: prefill instances")
    parser.add_argument("--decode", type=int, default=2, help="chaos: decode instances")
    parser.add_argument("--clients", type=int, default=6, help="closed-loop clients (half streaming)")
    parser.add_argument("--kill-every-s", type=float, default=30.0, help="chaos: seconds between kills")
    parser.add_argument("--baseline-s", type=float, default=30.0, help="chaos: first seconds without kills")
    parser.add_argument("--max-tokens", type=int, default=24, help="output tokens per request")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a request not done by then is hung")
    parser.add_argument("--kv-deadline-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="kvwire-bench-soak.log", help="the cluster's process output")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


@dataclasses.dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed_clear: int = 0
    failed_broken: int = 0
    hung: int = 0
    latencies_s: list[float] = dataclasses.field(default_factory=list)
    baseline_latencies_s: list[float] = dataclasses.field(default_factory=list)  # before the first kill
    errors: list[str] = dataclasses.field(default_factory=list)
    faults_started = False

    def add(self, outcome: str, result: RequestResult) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome == "ok":
            self.latencies_s.append(result.e2e_s)
            if not self.faults_started:
                self.baseline_latencies_s.append(result.e2e_s)
        elif len(self.errors) < 20:
            self.errors.append(f"{outcome}: {result.status} {(result.error or '')[:200]}")


def classify(result: RequestResult, max_tokens: int, timeout_s: float) -> str:
    if result.ok and result.finish_reason is not None and len(result.token_ids) == max_tokens:
        return "ok"
    if result.status == 0 and result.e2e_s >= timeout_s * 0.99:
        return "hung"
    if result.error is not None and (result.status >= 400 or "'message'" in result.error):
        return "failed_clear"  # an HTTP error, or an OpenAI-style error event in the stream
    return "failed_broken"


async def _client(url: str, tally: Tally, stop: threading.Event, rng: random.Random, stream: bool,
                  args: argparse.Namespace) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(8, 200))]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": stream, "return_token_ids": True}
            tally.sent += 1
            result = await post_completion(session, f"{url}/v1/completions", body, timeout_s=args.timeout_s)
            tally.add(classify(result, args.max_tokens, args.timeout_s), result)


def _load(url: str, tally: Tally, stop: threading.Event, args: argparse.Namespace) -> None:
    async def main() -> None:
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
        await asyncio.gather(*(_client(url, tally, stop, rngs[i], i % 2 == 0, args)
                               for i in range(args.clients)))
    asyncio.run(main())


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def _blocks_in_use(cluster: LocalCluster) -> int:
    total = 0.0
    for inst in cluster.live_instances():
        if inst.url is not None:
            with contextlib.suppress(OSError):
                total += _metric(inst.url, "kvwire_kv_blocks_in_use")
    return int(total)


def _kill_and_restart(cluster: LocalCluster, rng: random.Random, restart: bool, role: str | None) -> str:
    """SIGKILL a random live instance (of ``role``) whose role keeps another live one."""
    live = cluster.live_instances()
    candidates = [i for i in live if (role is None or i.role.value == role)
                  and sum(j.role is i.role for j in live) >= 2]
    victim = rng.choice(candidates)
    cluster.kill(victim.name, signal.SIGKILL)
    victim.process.wait_exit(10)
    if restart:
        cluster.start_instance(f"{victim.role.value}-r{int(time.monotonic() * 1000) % 10**7}", victim.role)
        cluster.wait_ready(120)
    return victim.name


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    spec: ClusterSpec
    kills_at_s: tuple[float, ...]  # offsets of kills from the load's start
    restart: bool
    kill_role: str | None


def run_one(run: Run, args: argparse.Namespace, sink: Any) -> dict[str, Any]:
    tally, stop = Tally(), threading.Event()
    duration_s = args.minutes * 60
    rng = random.Random(args.seed)
    killed: list[str] = []
    with LocalCluster(run.spec, sink=sink) as cluster:
        print(f"kvwire bench soak: {run.name} up at {cluster.router_url}", file=sys.stderr)
        load = threading.Thread(target=_load, args=(cluster.router_url, tally, stop, args), daemon=True)
        start = time.monotonic()
        load.start()
        for at in run.kills_at_s:
            if not _sleep_until(start + at, load):
                break
            tally.faults_started = True
            killed.append(_kill_and_restart(cluster, rng, run.restart, run.kill_role))
            print(f"kvwire bench soak: {run.name}: killed {killed[-1]} at {time.monotonic() - start:.0f} s",
                  file=sys.stderr)
        _sleep_until(start + duration_s, load)
        stop.set()
        load.join(args.timeout_s + 30)
        hung_threads = int(load.is_alive())
        wait_until(lambda: _blocks_in_use(cluster) == 0, 10.0, interval_s=0.5)
        leaked = _blocks_in_use(cluster)
        migrated = int(_metric(cluster.router_url, "kvwire_router_migrations_total"))
    lat, base = sorted(tally.latencies_s), sorted(tally.baseline_latencies_s)
    return {"run": run.name, "sent": tally.sent, "ok": tally.ok, "failed_clear": tally.failed_clear,
            "failed_broken": tally.failed_broken, "hung": tally.hung + hung_threads, "migrated": migrated,
            "leaked_blocks": leaked, "kills": len(killed), "p50_s": _q(lat, 0.5), "p99_s": _q(lat, 0.99),
            "p99_before_kills_s": _q(base, 0.99),
            "ok_pct": 100.0 * tally.ok / max(1, tally.sent), "errors": tally.errors}


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _sleep_until(when: float, load: threading.Thread) -> bool:
    while time.monotonic() < when:
        if not load.is_alive():
            return False
        time.sleep(min(0.5, max(0.0, when - time.monotonic())))
    return True


def plan(args: argparse.Namespace) -> list[Run]:
    base = {"heartbeat_interval_s": 0.5, "instance_ttl_s": 2.0, "kv_deadline_s": args.kv_deadline_s,
            "start_timeout_s": 300.0}
    duration_s = args.minutes * 60
    if args.scenario == "kill-decode":
        runs = []
        for name, router_args in (("max-migrations 0 (baseline)", ("--max-migrations", "0")),
                                  ("default (max-migrations 3)", ())):
            spec = ClusterSpec(num_prefill=1, num_decode=2, router_args=router_args, **base)
            runs.append(Run(name, spec, (duration_s / 3,), restart=False, kill_role="decode"))
        return runs
    spec = ClusterSpec(num_prefill=args.prefill, num_decode=args.decode, **base)
    kills, at = [], args.baseline_s + args.kill_every_s
    while at < duration_s - 5:
        kills.append(at)
        at += args.kill_every_s
    return [Run(f"{args.prefill}P{args.decode}D chaos", spec, tuple(kills), restart=True, kill_role=None)]


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["run", "sent", "ok", "failed_clear", "failed_broken", "hung", "migrated", "leaked_blocks",
            "kills", "ok_pct", "p50_s", "p99_s", "p99_before_kills_s"]
    print(" | ".join(cols))
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print(" | ".join(cells))
    for row in rows:
        for err in row["errors"][:5]:
            print(f"  {row['run']}: {err}")


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.clients <= 0 or args.max_tokens <= 0:
        print("kvwire bench soak: --minutes, --clients and --max-tokens must be > 0", file=sys.stderr)
        return 2
    rows = []
    try:
        with open(args.log, "w") as sink:
            for one in plan(args):
                rows.append(run_one(one, args, sink))
    except ClusterError as exc:
        print(f"kvwire bench soak: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    bad = any(r["hung"] or r["leaked_blocks"] for r in rows)
    return 1 if bad else 0
