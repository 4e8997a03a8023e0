"""``kvwire bench router``: router overhead against a mock upstream that answers at once.

Processes (each pinned to its own core where the machine has them, with ``os.sched_setaffinity``):
the router (``kvwire router``, uvloop when installed), one mock upstream (a raw asyncio HTTP server
returning a canned completion, registered through a real :class:`HeartbeatClient`), and this
process as the load generator (a raw keep-alive HTTP/1.1 client). The baseline is the same client
calling the upstream directly, in the same run.

Reported: latency p50/p99 at concurrency 1 (direct, routed, added) and requests/s at concurrency
``--concurrency`` (direct, routed). Goals: p50 added <= 1 ms, >= 1,500 req/s non-streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvwire.cluster.process import ManagedProcess, kvwire_argv, wait_until
from kvwire.protocol.kv_params import Role
from kvwire.router.cli import run_event_loop

_CANNED = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "text": " hello", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
}).encode()
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_CANNED)).encode() + b"\r\n\r\n" + _CANNED
)
_STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL
_SINK_LOCK = threading.Lock()  # children's output lines, prefixed, to our stderr
_BODY = json.dumps({"model": "bench", "prompt": "Say hello to the router bench", "max_tokens": 1}).encode()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--latency-requests", type=int, default=2000, help="sequential requests per target")
    parser.add_argument("--throughput-requests", type=int, default=6000, help="requests per target, loaded")
    parser.add_argument("--concurrency", type=int, default=32, help="connections for the throughput phase")
    parser.add_argument("--policy", default="least_loaded", help="router policy")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--cpus", default=None,
                        help="comma-separated CPUs to use (default: all allowed)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")


# --- the mock upstream (a subprocess) -------------------------------------------------------------


class _CannedHTTP(asyncio.Protocol):
    """Answers every complete HTTP/1.1 request on the connection with the canned response."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            match = re.search(rb"(?i)content-length:\s*(\d+)", self.buf[:end])
            total = end + 4 + (int(match.group(1)) if match else 0)
            if len(self.buf) < total:
                return
            self.buf = self.buf[total:]
            self.transport.write(_RESPONSE)


async def _upstream_main(router_address: str) -> None:
    from kvwire.discovery import HeartbeatClient, InstanceInfo

    loop = asyncio.get_running_loop()
    server = await loop.create_server(_CannedHTTP, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    info = InstanceInfo(instance_id="bench-upstream", role=Role.BOTH,
                        url=f"http://127.0.0.1:{port}", model="bench")
    client = HeartbeatClient(router_address, info, interval_s=0.5).start()
    print(f"UPSTREAM_READY {port}", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    client.close()
    server.close()


# --- load generator -------------------------------------------------------------------------------


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str):
        self.reader, self.writer = reader, writer
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(_BODY)}\r\n\r\n"
        ).encode() + _BODY

    async def call(self) -> float:
        t0 = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"bad answer: {head[:80]!r}")
        match = re.search(rb"(?i)content-length:\s*(\d+)", head)
        await self.reader.readexactly(int(match.group(1)) if match else 0)
        return time.perf_counter() - t0


async def _connect(port: int, n: int) -> list[_Conn]:
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conns.append(_Conn(reader, writer, f"127.0.0.1:{port}", "/v1/completions"))
    return conns


async def _latency(port: int, n: int) -> list[float]:
    (conn,) = await _connect(port, 1)
    for _ in range(min(200, n)):  # warm-up
        await conn.call()
    samples = [await conn.call() for _ in range(n)]
    conn.writer.close()
    return samples


async def _throughput(port: int, n: int, concurrency: int) -> float:
    conns = await _connect(port, concurrency)
    left = n

    async def worker(conn: _Conn) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await conn.call()

    await asyncio.gather(*(worker(c) for c in conns[:concurrency]))  # warm-up round
    left = n
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.writer.close()
    return n / elapsed


# --- orchestration --------------------------------------------------------------------------------


def _spawn(name: str, argv: list[str], ready: str, cpus: set[int] | None,
           timeout_s: float = 30.0) -> tuple[ManagedProcess, str]:
    """Start ``argv`` (its output prefixed on stderr) and wait for its line containing ``ready``."""
    proc = ManagedProcess(name, argv, sink=sys.stderr, sink_lock=_SINK_LOCK,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)

    def ready_line() -> str | None:
        return next((line for line in proc.output().splitlines() if ready in line), None)

    wait_until(lambda: ready_line() is not None or proc.poll() is not None, timeout_s, 0.05)
    line = ready_line()
    if line is None:
        exited = proc.poll()
        proc.stop(_STOP_GRACE_S)
        why = f"exited with code {exited}" if exited is not None else f"not ready within {timeout_s:.0f} s"
        raise RuntimeError(f"{name} {argv[:4]} {why}; its output:\n{proc.output()[-2000:]}")
    return proc, line.strip()


def _cores(no_pin: bool, only: str | None) -> tuple[set[int] | None, set[int] | None, set[int] | None]:
    """(router, upstream, client) CPU sets: router alone on a core; the others share when short."""
    if no_pin or not hasattr(os, "sched_setaffinity"):
        return None, None, None
    cpus = sorted(os.sched_getaffinity(0))
    if only:
        cpus = [c for c in cpus if c in {int(x) for x in only.split(",")}]
    if len(cpus) >= 3:
        return {cpus[0]}, {cpus[1]}, {cpus[2]}
    if len(cpus) == 2:
        return {cpus[0]}, {cpus[1]}, {cpus[1]}
    return None, None, None


def _pct(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def _phase_timeout_s(num_requests: int) -> float:
    """Deadline of one measurement phase (generous: ~1 ms a request is typical); a target that stops
    answering fails the run instead of hanging it."""
    return 30.0 + 0.05 * num_requests


async def _measure(args: argparse.Namespace, direct: int, routed: int) -> dict[str, float]:
    lat_s, tput_s = _phase_timeout_s(args.latency_requests), _phase_timeout_s(args.throughput_requests)
    lat_d = await asyncio.wait_for(_latency(direct, args.latency_requests), lat_s)
    lat_r = await asyncio.wait_for(_latency(routed, args.latency_requests), lat_s)
    rps_d = await asyncio.wait_for(_throughput(direct, args.throughput_requests, args.concurrency), tput_s)
    rps_r = await asyncio.wait_for(_throughput(routed, args.throughput_requests, args.concurrency), tput_s)
    return {
        "direct_p50_ms": _pct(lat_d, 0.5), "direct_p99_ms": _pct(lat_d, 0.99),
        "routed_p50_ms": _pct(lat_r, 0.5), "routed_p99_ms": _pct(lat_r, 0.99),
        "added_p50_ms": statistics.median(lat_r) * 1e3 - statistics.median(lat_d) * 1e3,
        "added_p99_ms": _pct(lat_r, 0.99) - _pct(lat_d, 0.99),
        "direct_rps": rps_d, "routed_rps": rps_r,
    }


def _print(res: dict[str, float], pins: Any, concurrency: int) -> None:
    print(f"\nrouter benchmark (pinning router/upstream/client: {pins}; uvloop: {_has_uvloop()})")
    print(f"{'metric':<34}{'direct':>12}{'via router':>12}{'added':>12}{'goal':>12}")
    print(f"{'latency p50, c=1 (ms)':<34}{res['direct_p50_ms']:>12.3f}{res['routed_p50_ms']:>12.3f}"
          f"{res['added_p50_ms']:>12.3f}{'<= 1.000':>12}")
    print(f"{'latency p99, c=1 (ms)':<34}{res['direct_p99_ms']:>12.3f}{res['routed_p99_ms']:>12.3f}"
          f"{res['added_p99_ms']:>12.3f}{'':>12}")
    print(f"{f'requests/s, c={concurrency}':<34}{res['direct_rps']:>12.0f}{res['routed_rps']:>12.0f}"
          f"{'':>12}{'>= 1500':>12}")


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    router_cpus, upstream_cpus, client_cpus = _cores(args.no_pin, args.cpus)
    router_cmd = kvwire_argv("--log-level=WARNING", "router", "--port", "0", "--discovery-port", "0",
                             "--policy", args.policy)
    router, line = _spawn("router", router_cmd, "kvwire router:", router_cpus)
    upstream = None
    try:
        m = re.search(r"http://[\d.]+:(\d+) \(discovery (tcp://[\d.]+:\d+)\)", line)
        assert m is not None, line
        routed_port, discovery = int(m.group(1)), m.group(2)
        upstream, up_line = _spawn("upstream", [sys.executable, "-m", "kvwire.bench.router", "upstream",
                                                discovery], "UPSTREAM_READY", upstream_cpus)
        direct_port = int(up_line.split()[1])
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        _wait_routable(routed_port)
        res = run_event_loop(_measure(args, direct_port, routed_port))
    finally:
        if upstream is not None:
            upstream.stop(_STOP_GRACE_S)
        router.stop(_STOP_GRACE_S)
    pins = "off" if router_cpus is None else f"{sorted(router_cpus)}/{sorted(upstream_cpus or [])}/" \
        f"{sorted(client_cpus or [])}"
    _print(res, pins, args.concurrency)
    if args.json:
        print(json.dumps(res))
    return 0


def _wait_routable(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            run_event_loop(asyncio.wait_for(_latency(port, 1), 5.0))
            return
        except (RuntimeError, asyncio.TimeoutError):  # 503 until the upstream's first heartbeat lands
            time.sleep(0.05)
    raise RuntimeError("router never routed to the upstream")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "upstream":
        run_event_loop(_upstream_main(sys.argv[2]))
    else:
        parser = argparse.ArgumentParser(prog="kvwire bench router")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
