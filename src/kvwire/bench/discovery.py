"""``kvwire bench discovery``: the router's discovery with N simulated instances, per backend.

This process is the router under test: the real :class:`~kvwire.router.registry.Registry`, the
real discovery backend (the ZeroMQ listener + TTL sweeper, or the etcd watcher on an asyncio loop)
and the real :class:`~kvwire.router.selection.Selector` (policy ``least_loaded``), without HTTP.
The instances are simulated by one child process (:mod:`kvwire.bench.discovery_sim`): N of them,
half prefill, half decode, announcing a new load every ``--interval-s`` (1 s). With ``etcd``, a
local etcd is started unless ``--etcd`` names one.

Measured per backend and N (default 10, 100, 1000), in one run:

* router CPU: this process's CPU time (all threads) over a ``--window-s`` steady-state window
  in which it does nothing but discovery, in % of one core; etcd's own CPU is shown beside it;
* update latency: an instance's send (its ``sent_at``) to the registry applying it, p50/p99;
* routing decision: ``plan`` + pick P + pick D on the live registry while updates keep coming,
  p50/p99 of its wall time, and p99 of "due -> decided": one decision is due every millisecond (a
  timer on the router's event loop, as a request's arrival would be) and timed from when it was
  due, so the wait for a loop busy with discovery work (watch messages, sweeps) is included;
* death -> removal: 10 % of the instances stop announcing at once but keep their connections
  (a SIGSTOP, a network cut); time until each is out of routing, p50/max, from the kill and from
  the later of the kill and the instance's last announcement (``last``: a call under way at the
  kill still arrives; the instance was alive when it left). ZeroMQ also shows a
  crash (connections closed, as kill -9 does), which the router sees without waiting for a TTL.

Goals at N = 1,000: CPU <= 10 % of a core, death detected <= 3 heartbeat intervals (ZeroMQ) or the
lease TTL + 1 s (etcd), decision p99 <= 1 ms. N = 10 is the baseline each figure grows from.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import queue
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from kvwire.discovery.address import parse_discovery_address
from kvwire.discovery.etcd_client import lease_ttl_for
from kvwire.discovery.heartbeats import Deregister, Heartbeat
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy, RouterConfig
from kvwire.router.discovery_backend import EtcdDiscovery, ZmqDiscovery
from kvwire.router.registry import ApplyResult, Registry
from kvwire.router.selection import Selector
from kvwire.server.config import ServerConfig

MODEL = "sim"
# The ZeroMQ heartbeat TTL in heartbeat intervals: the router's and ``kvwire up``'s default ratio
# (decision 109).
ZMQ_TTL_INTERVALS = RouterConfig().instance_ttl_s / ServerConfig().heartbeat_interval_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", default="10,100,1000", help="instance counts (default %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (the table goes to stderr)")
    parser.add_argument("--backends", default="zmq,etcd", help="zmq, etcd or both (default %(default)s)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="heartbeat interval (default 1 s)")
    parser.add_argument("--window-s", type=float, default=10.0, help="CPU window (default %(default)s)")
    parser.add_argument("--decisions", type=int, default=3000, help="routing decisions timed")
    parser.add_argument("--kill-fraction", type=float, default=0.1, help="instances killed per test")
    parser.add_argument("--etcd", default=None, metavar="etcd://HOST:PORT",
                        help="use this etcd (default: start a local one; needs the etcd binary)")


class TimedRegistry(Registry):
    """A registry that records each applied heartbeat's latency (send -> applied) while asked to."""

    def __init__(self, ttl_s: float) -> None:
        super().__init__(ttl_s)
        self.recording = False
        self.latencies: list[float] = []

    def apply(self, msg: Heartbeat | Deregister) -> ApplyResult:
        result = super().apply(msg)
        self._record([msg], [result])
        return result

    def apply_many(self, msgs: list[Heartbeat | Deregister]) -> list[ApplyResult]:
        results = super().apply_many(msgs)
        self._record(msgs, results)
        return results

    def _record(self, msgs: list[Heartbeat | Deregister], results: list[ApplyResult]) -> None:
        if self.recording:
            now = time.time()
            self.latencies.extend(now - m.sent_at for m, r in zip(msgs, results, strict=True)
                                  if isinstance(m, Heartbeat) and r is not ApplyResult.STALE)

    def live_count(self) -> int:
        return len(self.live(Role.PREFILL)) + len(self.live(Role.DECODE))


@dataclass
class Result:
    backend: str
    n: int
    register_s: float = 0.0
    updates_per_s: float = 0.0
    cpu_pct: float = 0.0
    etcd_cpu_pct: float | None = None
    update_ms: tuple[float, float] = (0.0, 0.0)
    decision_us: tuple[float, float, float] = (0.0, 0.0, 0.0)  # p50, p99; p99 of CPU time
    due_us: tuple[float, float] = (0.0, 0.0)  # p99 of due -> decided: wall; the loop thread's CPU
    silent: Deaths | None = None
    crash: Deaths | None = None
    sim: dict[str, Any] = field(default_factory=dict)


class SimProcess:
    """The child simulating the instances; lines it prints are queued for :meth:`expect`."""

    def __init__(self, backend: str, address: str, n: int, interval_s: float) -> None:
        argv = [sys.executable, "-m", "kvwire.bench.discovery_sim", backend, address, str(n), str(interval_s)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    async def expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = await asyncio.to_thread(self.lines.get, True, 0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"simulator: no {prefix!r} within {timeout_s} s (exit code {self.proc.poll()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


def _pct(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _decisions(
    registry: Registry, count: int
) -> tuple[tuple[float, float, float], tuple[float, float]]:
    """p50 and p99 of a decision's wall time and p99 of its own CPU time (this thread's: without
    the time the process waited for a core or for the GIL), in µs; and p99 of due -> decided (µs):
    each decision falls due 1 ms after the previous one ended, on the event loop's timer, and is
    timed from then, so the time the loop was busy elsewhere (discovery) when it fell due counts;
    beside it the p99 of the CPU time the loop's thread spent from scheduling the decision to
    making it (the decision and whatever discovery work ran on the loop meanwhile: what the
    design costs a request, without the waits for a core on a shared box)."""
    selector = Selector(registry, Policy.LEAST_LOADED, seed=1)
    wall, cpu, due, due_cpu = [], [], [], []
    for _ in range(count):
        t_due, c_sched = time.perf_counter() + 0.001, time.thread_time()
        await asyncio.sleep(0.001)
        c0, t0 = time.thread_time(), time.perf_counter()
        selector.plan(MODEL)
        selector.pick(Role.PREFILL, MODEL)
        selector.pick(Role.DECODE, MODEL)
        t1 = time.perf_counter()
        wall.append(t1 - t0)
        cpu.append(time.thread_time() - c0)
        due.append(t1 - t_due)
        due_cpu.append(time.thread_time() - c_sched)
    decision = (_pct(wall, 0.5) * 1e6, _pct(wall, 0.99) * 1e6, _pct(cpu, 0.99) * 1e6)
    return decision, (_pct(due, 0.99) * 1e6, _pct(due_cpu, 0.99) * 1e6)


@dataclass(frozen=True)
class Deaths:
    """Times until the killed instances were out of routing (s): from the kill (p50, max) and from
    the later of the kill and each one's last announcement (p50, max): a call already under way
    when the instance stopped still arrives, so the instance really fell silent when it left."""

    from_kill: tuple[float, float]
    from_last: tuple[float, float]


async def _deaths(sim: SimProcess, registry: Registry, k: int, how: str, limit_s: float) -> Deaths:
    sim.send(f"kill {how} {k}")
    words = (await sim.expect("KILLED", 10)).split()
    t_kill, ids = float(words[1]), words[2].split(",")
    removed: dict[str, float] = {}  # wall time each one was seen out of routing
    deadline = time.monotonic() + limit_s
    while len(removed) < len(ids) and time.monotonic() < deadline:
        now = time.time()
        for ident in ids:
            view = registry.get(ident)
            if ident not in removed and (view is None or not view.alive):
                removed[ident] = now
        await asyncio.sleep(0.005)
    if len(removed) < len(ids):
        left = len(ids) - len(removed)
        raise RuntimeError(f"{left} of {len(ids)} dead instances still routed after {limit_s} s")
    from_kill = [removed[i] - t_kill for i in ids]
    sim.send(f"last_sent {','.join(ids)}")
    last_sent = json.loads((await sim.expect("LAST_SENT", 10)).split(" ", 1)[1])
    from_last = [removed[i] - max(t_kill, last_sent[i]) for i in ids]
    return Deaths(_p50_max(from_kill), _p50_max(from_last))


def _p50_max(times: Sequence[float]) -> tuple[float, float]:
    return statistics.median(times), max(times)


async def _run_one(backend: str, n: int, args: argparse.Namespace, etcd_address: str | None,
                   etcd_pid: int | None) -> Result:
    interval = args.interval_s
    res = Result(backend, n)
    registry = TimedRegistry(ttl_s=ZMQ_TTL_INTERVALS * interval)
    discovery: ZmqDiscovery | EtcdDiscovery
    if backend == "zmq":
        cfg = RouterConfig(discovery_port=0, instance_ttl_s=ZMQ_TTL_INTERVALS * interval)
        discovery = ZmqDiscovery(registry, cfg)
    else:
        assert etcd_address is not None
        discovery = EtcdDiscovery(registry, parse_discovery_address(etcd_address))
    death_limit = death_limit_s(backend, interval)
    await discovery.start()
    t_start = time.monotonic()
    sim = SimProcess(backend, discovery.address, n, interval)
    try:
        await sim.expect("SIM_READY", 120 + n * 0.05)
        deadline = time.monotonic() + 120
        while registry.live_count() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {registry.live_count()} of {n} instances registered")
            await asyncio.sleep(0.01)
        res.register_s = time.monotonic() - t_start
        await asyncio.sleep(2 * interval)  # settle: every instance in its steady rhythm
        applied0 = sum(discovery.received.values())
        etcd0 = _proc_cpu_s(etcd_pid) if etcd_pid else 0.0
        registry.latencies.clear()
        registry.recording = True
        cpu0, t0 = _cpu_s(), time.monotonic()
        await asyncio.sleep(args.window_s)
        cpu1, t1 = _cpu_s(), time.monotonic()
        registry.recording = False
        res.cpu_pct = 100 * (cpu1 - cpu0) / (t1 - t0)
        if etcd_pid and backend == "etcd":
            res.etcd_cpu_pct = 100 * (_proc_cpu_s(etcd_pid) - etcd0) / (t1 - t0)
        res.updates_per_s = (sum(discovery.received.values()) - applied0) / (t1 - t0)
        lat = registry.latencies
        res.update_ms = (_pct(lat, 0.5) * 1e3, _pct(lat, 0.99) * 1e3)
        res.decision_us, res.due_us = await _decisions(registry, args.decisions)
        k = max(1, int(n * args.kill_fraction))
        res.silent = await _deaths(sim, registry, k, "silent", death_limit + 10)
        if backend == "zmq":
            res.crash = await _deaths(sim, registry, k, "crash", death_limit + 10)
        if isinstance(discovery, EtcdDiscovery):
            print(f"    etcd watch checks: {dict(discovery.probes)}", file=sys.stderr, flush=True)
        sim.send("stats")
        res.sim = json.loads((await sim.expect("STATS", 10)).split(" ", 1)[1])
    finally:
        await asyncio.to_thread(sim.close)
        await discovery.stop()
    return res


def _row(r: Result, interval: float) -> str:
    etcd = f"{r.etcd_cpu_pct:5.1f}" if r.etcd_cpu_pct is not None else "    -"
    crash = f"{r.crash.from_kill[1]:6.3f}" if r.crash is not None else "     -"
    dead = r.silent.from_kill if r.silent is not None else (float("nan"),) * 2
    last_max = f"{r.silent.from_last[1]:6.2f}" if r.silent is not None else "     -"
    return (f"{r.backend:<5} {r.n:>5} {r.register_s:6.1f} {r.updates_per_s:8.0f} {r.cpu_pct:6.1f} {etcd} "
            f"{r.update_ms[0]:7.2f} {r.update_ms[1]:7.2f} {r.decision_us[0]:7.0f} {r.decision_us[1]:7.0f} "
            f"{r.decision_us[2]:7.0f} {r.due_us[0]:7.0f} {r.due_us[1]:7.0f} {dead[0]:6.2f} {dead[1]:6.2f} "
            f"{last_max}  {crash}")


HEADER = ("backend     N  reg_s  upd/s  cpu%  etcd%  upd_p50 upd_p99  dec_p50 dec_p99 dec_cpu99 due_p99 "
          "due_cpu99 dead_p50 dead_max last_max crash_max\n"
          "                          (router)        (ms)    (ms)     (us)    (us)    (us)    (us)    (us)"
          "     (s)    (s)      (s)     (s)")
FOOTER = ("dec: wall time of plan + pick P + pick D; dec_cpu99: p99 of the same decisions' own CPU time "
          "(without waits for a core or the GIL); due_p99: p99 from when a decision fell due on the "
          "event loop to when it was made (includes the loop being busy with discovery), due_cpu99 the "
          "same in the loop thread's CPU time (without waits for a core)\n"
          "dead: from the kill; last_max: from the later of the kill and the instance's last "
          "announcement (one under way at the kill still arrives)")


def death_limit_s(backend: str, interval: float) -> float:
    """The goal: 3 heartbeat intervals (ZeroMQ), the lease TTL + 1 s (etcd)."""
    return 3 * interval if backend == "zmq" else lease_ttl_for(interval) + 1.0


def _goals(r: Result, interval: float) -> str:
    limit = death_limit_s(r.backend, interval)
    dead = r.silent.from_kill[1] if r.silent is not None else float("nan")
    checks = [
        (f"router CPU {r.cpu_pct:.1f} % <= 10 %", r.cpu_pct <= 10.0),
        (f"death max {dead:.2f} s <= {limit:.1f} s", dead <= limit),
        (f"decision p99 {r.decision_us[1] / 1e3:.3f} ms <= 1 ms", r.decision_us[1] <= 1000.0),
    ]
    return f"{r.backend} N={r.n}: " + "; ".join(f"{text} {'OK' if ok else 'MISSED'}" for text, ok in checks)


async def _main(args: argparse.Namespace) -> int:
    ns = [int(x) for x in args.n.split(",") if x]
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ("zmq", "etcd"):
            print(f"kvwire bench discovery: unknown backend {b!r} (zmq, etcd)", file=sys.stderr)
            return 2
    etcd: Any = None
    etcd_address, etcd_pid = args.etcd, None
    if "etcd" in backends and etcd_address is None:
        from kvwire.cluster.etcd import EtcdUnavailable, LocalEtcd

        try:
            etcd = LocalEtcd(sink=open(os.devnull, "w")).start()  # noqa: SIM115 - closed with the process
        except EtcdUnavailable as exc:
            print(f"kvwire bench discovery: {exc}; skipping the etcd backend", file=sys.stderr)
            backends.remove("etcd")
        else:
            etcd_address, etcd_pid = etcd.discovery, etcd.process.pid
    results = []
    print(f"kvwire bench discovery: heartbeat/load update every {args.interval_s} s, CPU window "
          f"{args.window_s} s, {args.decisions} decisions, {args.kill_fraction:.0%} killed; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at the start")
    print(HEADER, flush=True)
    try:
        for backend in backends:
            for n in ns:
                print(f"... {backend} N={n}", file=sys.stderr, flush=True)
                try:
                    results.append(await _run_one(backend, n, args, etcd_address, etcd_pid))
                except RuntimeError as exc:  # a missed deadline: say so in the table, go on
                    print(f"{backend:<5} {n:>5} FAILED: {exc}", flush=True)
                    continue
                print(_row(results[-1], args.interval_s), flush=True)  # each row as it is measured
    finally:
        if etcd is not None:
            etcd.stop()
    print(f"{FOOTER}\nload average {os.getloadavg()[0]:.1f} at the end")
    for r in results:
        if r.n == max(ns):
            print("goal " + _goals(r, args.interval_s))
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2), file=args.json_out)
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    raise KeyboardInterrupt  # SIGTERM too unwinds through the finally blocks (etcd, simulator)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("kvwire.router").setLevel(logging.ERROR)  # 1,000 "registered"/"expired" lines
    logging.getLogger("kvwire.discovery").setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if not args.json:
            return asyncio.run(_main(args))
        args.json_out = sys.stdout  # the JSON; the table, as it is measured, goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            return asyncio.run(_main(args))
    except KeyboardInterrupt:
        print("kvwire bench discovery: interrupted", file=sys.stderr)
        return 130
