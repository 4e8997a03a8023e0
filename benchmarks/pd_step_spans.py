"""Where a prefill instance's step goes for a P/D request against a plain one (decision 147).

Starts a 1P1D cluster (tiny model, CPU, push, default plane) whose prefill instance loads
``benchmarks/pd_step_spans_site/sitecustomize.py`` (timers around its engine steps; nothing in
``src/``). Then, per round, ``--requests`` sequential streamed requests through the router (P/D)
and as many straight to P without ``kv_transfer_params`` (plain); with ``--direct``, also P/D
requests straight to P (the router's push params naming D, D idle: no router, no D admission
beside P's step), and with ``--stop-decode`` the same with D's process stopped (SIGSTOP: no early
grant, no Offer handled by D). For each phase and kind of step it prints medians: the wait from
the request's arrival to its step, the step's wall and engine-thread CPU time, the CPU time each
thread of P and the decode, router and client processes used during the step, and the spans
(wall / CPU) of the connector's and the agent's calls; also the CPU each thread and process used
from the request's arrival to its step, and the other threads' calls (the transfer control loop's
by message type, the HTTP loop's) from the arrival to the step's end. ``--defer``: every other
request with P's control thread reading no message while P's engine steps (what P gains if D's
early Grant waits for P's forward; decision 160). ``--rate R``: instead of sequential
requests, P/D requests through the router at R a second (Poisson), ``--output-len`` tokens each,
as ``kvwire bench serve`` sends them. Run from a worktree root:

    PYTHONPATH=src python benchmarks/pd_step_spans.py --rounds 2 --requests 20 --direct --stop-decode
    PYTHONPATH=src python benchmarks/pd_step_spans.py --rounds 4 --requests 20 --defer
    PYTHONPATH=src python benchmarks/pd_step_spans.py --rounds 4 --requests 48 --rate 4 --defer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvwire.cluster.local import ClusterSpec, LocalCluster, http_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_prefill_ttft import _post, _prompts

SITE = Path(__file__).resolve().parent / "pd_step_spans_site"


@contextlib.contextmanager
def site_environment(site: Path, env: dict[str, str]) -> Iterator[None]:
    """``env`` set and ``site`` (a folder with a ``sitecustomize``) first on the children's path, for
    the cluster started inside; the parent's environment restored after."""
    saved = dict(os.environ)
    os.environ.update(env)
    paths = filter(None, saved.get("PYTHONPATH", "").split(os.pathsep))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *paths])
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def probed_cluster(site: Path, out_env: str) -> Iterator[tuple[LocalCluster, Path]]:
    """A local 1P1D cluster whose processes load ``site``'s sitecustomize (only they: the environment
    is restored once they started), and the temporary folder they write to, named by ``out_env``."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "cluster.log", "w") as sink:
        out = Path(tmp)
        with site_environment(site, {out_env: str(out)}):
            cluster = LocalCluster(ClusterSpec(), sink=sink)
            cluster.__enter__()
        try:
            yield cluster, out
        finally:
            cluster.__exit__(None, None, None)


def _requests(
    url: str, prompts: list[list[int]], max_tokens: int, gap_s: float, kv: dict[str, Any] | None = None,
    defer: Path | None = None,
) -> float:
    """Sequential streamed requests; the client's TTFT p50 (ms). ``defer``: the file that turns the
    deferral on, there for every other request."""
    ttft = []
    for i, prompt in enumerate(prompts):
        if defer is not None and i % 2:
            defer.touch()
        elif defer is not None:
            defer.unlink(missing_ok=True)
        body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True}
        if kv is not None:
            body["kv_transfer_params"] = dict(kv, transfer_id=f"spans-{time.monotonic_ns()}-{i}")
        ttft.append(_post(url, body))
        time.sleep(gap_s)
    return 1e3 * statistics.median(ttft)


def _load(url: str, prompts: list[list[int]], max_tokens: int, rate: float, seed: int) -> float:
    """P/D requests at ``rate`` a second (Poisson arrivals, one thread each), as ``kvwire bench serve``
    sends them; the client's TTFT p50 (ms)."""
    rng, ttft, threads = random.Random(seed), [], []

    def one(prompt: list[int]) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        ttft.append(_post(url, body))

    for prompt in prompts:
        threads.append(threading.Thread(target=one, args=(prompt,)))
        threads[-1].start()
        time.sleep(rng.expovariate(rate))
    for thread in threads:
        thread.join(120)
    return 1e3 * statistics.median(ttft)


def _dump(out: Path, number: int) -> list[dict[str, Any]]:
    (out / "dump").touch()
    path = out / f"steps-{number}.json"
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    return list(json.loads(path.read_text()))


def _table(phase: str, rows: list[dict[str, Any]]) -> None:
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    for kind in sorted({r["kind"] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        queue, wall, cpu = (med([r[k] for r in rs]) for k in ("queue_us", "wall_us", "cpu_us"))
        print(f"\n{phase}, {kind} steps: {len(rs)}; medians (us): arrival -> step {queue:.0f}, "
              f"step wall {wall:.0f}, engine-thread CPU {cpu:.0f}")
        names = {n for r in rs for n in r["cpu_us_meanwhile"]}
        busy = {n: med([r["cpu_us_meanwhile"].get(n, 0.0) for r in rs]) for n in names}
        used = ", ".join(f"{n} {v:.0f}" for n, v in sorted(busy.items()) if v)
        print(f"  CPU used during the step: {used}")
        names = {n for r in rs for n in r.get("cpu_us_before", {})}
        busy = {n: med([r["cpu_us_before"].get(n, 0.0) for r in rs]) for n in names}
        used = ", ".join(f"{n} {v:.0f}" for n, v in sorted(busy.items()) if v)
        print(f"  CPU used from the arrival to the step: {used}")
        for name in sorted({n for r in rs for n in r["spans"]}):
            wall = med([r["spans"].get(name, [0.0, 0.0])[0] for r in rs])
            cpu = med([r["spans"].get(name, [0.0, 0.0])[1] for r in rs])
            print(f"  {name:50s} wall {wall:7.0f}  CPU {cpu:7.0f}")
        print("  other threads' calls from the arrival to the step's end (means a step):")
        for name in sorted({n for r in rs for n in r.get("other_spans", {})}):
            got = [r["other_spans"].get(name, [0.0, 0.0, 0]) for r in rs]
            wall, cpu, calls = (statistics.mean(g[k] for g in got) for k in range(3))
            print(f"  {name:50s} wall {wall:7.0f}  CPU {cpu:7.0f}  calls {calls:4.1f}")


def _phases(cluster: LocalCluster, out: Path, args: argparse.Namespace) -> None:
    insts = {i.role.value: i for i in cluster.instances.values()}
    p, d = insts["prefill"], insts["decode"]
    assert p.url is not None and cluster.router is not None
    (out / "pids.json").write_text(json.dumps({"decode": d.process.pid, "router": cluster.router.pid,
                                               "client": os.getpid()}))
    views = json.loads(http_text(cluster.router_url + "/instances"))
    dv = next(v for v in views if v["role"] == "decode")
    kv = {"mode": "push", "role": "prefill", "peer_endpoints": dv["kv_endpoints"], "deadline_s": 30.0,
          "peer_instance_id": dv["id"], "limit_s": 300.0, "peer_kv_layout": dv["kv_layout"]}
    _requests(cluster.router_url, _prompts(0, 4, args.input_len), 4, args.gap_s)  # warm-up
    _requests(p.url, _prompts(1, 4, args.input_len), 1, args.gap_s)
    _dump(out, 1)
    if args.rate:
        _under_load(cluster, out, args)
        return
    phases = [("P/D through the router, plain to P", cluster.router_url, None, False)]
    phases += [("P/D straight to P, D idle", p.url, kv, False)] if args.direct else []
    phases += [("P/D straight to P, D stopped", p.url, kv, True)] if args.stop_decode else []
    seed = 2
    for number, (phase, url, params, stop) in enumerate(phases, start=2):
        if stop:
            os.kill(d.process.pid, signal.SIGSTOP)
        try:
            for r in range(args.rounds):
                load, n = os.getloadavg()[0], args.requests
                pd_tokens = 1 if params else 4  # straight to P: P's one-token answer, as the router asks
                pd_prompts, plain_prompts = (_prompts(seed + k, n, args.input_len) for k in (0, 1))
                seed += 2
                defer = out / "defer" if args.defer else None  # every other request
                a = _requests(url, pd_prompts, pd_tokens, args.gap_s, params, defer)
                b = _requests(p.url, plain_prompts, 1, args.gap_s, None, defer)
                (out / "defer").unlink(missing_ok=True)
                print(f"{phase}, round {r}, load {load:.2f}: client TTFT p50 P/D {a:.2f} ms, plain "
                      f"{b:.2f} ms", flush=True)
            rows = _dump(out, number)
        finally:
            if stop:
                os.kill(d.process.pid, signal.SIGCONT)
        _table(phase, rows)


def _under_load(cluster: LocalCluster, out: Path, args: argparse.Namespace) -> None:
    """P/D requests through the router at ``--rate`` (``--output-len`` tokens each), per round; with
    ``--defer``, rounds alternate with P's control thread reading nothing while P steps."""
    seed = 2
    for r in range(args.rounds):
        modes = ["", "defer"] if args.defer else [""]
        for mode in modes if r % 2 == 0 else modes[::-1]:
            if mode:
                (out / "defer").touch()
            load = os.getloadavg()[0]
            prompts = _prompts(seed, args.requests, args.input_len)
            ttft = _load(cluster.router_url, prompts, args.output_len, args.rate, seed)
            (out / "defer").unlink(missing_ok=True)
            seed += 1
            print(f"P/D at {args.rate} req/s, round {r}{' ' + mode if mode else ''}, load {load:.2f}: "
                  f"client TTFT p50 {ttft:.2f} ms", flush=True)
    _table(f"P/D at {args.rate} req/s", _dump(out, 2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--gap-s", type=float, default=0.15)
    ap.add_argument("--rate", type=float, default=0.0, help=(
        "instead of sequential requests: P/D requests through the router at this rate (Poisson), "
        "--requests a round, --output-len tokens each, as kvwire bench serve sends them"))
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--direct", action="store_true", help="also P/D requests straight to P, D idle")
    ap.add_argument("--defer", action="store_true", help=(
        "every other request with P's transfer control thread reading no message while P's engine "
        "steps (what P gains if D's early Grant waits); with --rate, every other round"))
    ap.add_argument("--stop-decode", action="store_true", help="also P/D requests straight to P, D stopped")
    args = ap.parse_args(argv)
    with probed_cluster(SITE, "PD_STEP_SPANS_DIR") as (cluster, out):
        _phases(cluster, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
