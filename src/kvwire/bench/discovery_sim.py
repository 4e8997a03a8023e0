"""N simulated instances in one process, for ``kvwire bench discovery`` (no engine, no HTTP).

Run by the benchmark as ``python -m kvwire.bench.discovery_sim BACKEND ADDRESS N INTERVAL_S``.
Instance ``i`` is a prefill (even ``i``) or decode (odd) instance of model ``sim`` with its own URL
and KV endpoint. Each one announces itself every ``INTERVAL_S`` with a new load, the rounds spread
evenly over the interval:

* ``zmq``: one ZeroMQ PUSH socket (its own TCP connection) per instance, the messages built and
  signed by the same :func:`~kvwire.discovery.messages.encode_frames` the real client uses.
* ``etcd``: one real :class:`~kvwire.discovery.etcd_client.EtcdRegistration` per instance (its own
  HTTP connection, lease and key), driven by :meth:`~EtcdRegistration.tick` from a few worker
  threads instead of one thread each: a keep-alive and a load put per round.

Commands on stdin, answers on stdout: ``kill silent K`` (K running instances, spread over the round,
stop sending but keep their connections: a SIGSTOPped or cut-off instance) and ``kill crash K``
(likewise, but their connections are
closed as a kill -9 would) answer ``KILLED <wall time> <ids,...>``; ``stats`` answers
``STATS <json>``; ``quit`` (or stdin closed) stops everything. ``SIM_READY`` is printed after the
first round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys
import threading
import time
from collections.abc import Callable

import zmq

from kvwire.discovery.address import parse_discovery_address
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.etcd_gateway import EtcdError
from kvwire.discovery.messages import Heartbeat, InstanceInfo, InstanceLoad, InstanceRole, encode_frames

MODEL = "sim"
ETCD_WORKERS = 64  # blocking HTTP calls: threads wait on etcd, not on the CPU


def sim_info(i: int) -> InstanceInfo:
    role = InstanceRole.PREFILL if i % 2 == 0 else InstanceRole.DECODE
    return InstanceInfo(instance_id=f"sim-{i:05d}", role=role, url=f"http://127.0.0.1:{20000 + i}",
                        model=MODEL, kv_endpoints=[f"tcp://127.0.0.1:{40000 + i}"], version="sim")


def random_load(rng: random.Random) -> InstanceLoad:
    return InstanceLoad(num_running=rng.randrange(8), num_waiting=rng.randrange(4),
                        free_kv_blocks=rng.randrange(1024), total_kv_blocks=1024)


def _load_fn(rng: random.Random) -> Callable[[], InstanceLoad]:
    return lambda: random_load(rng)


class Sim:
    """Rounds over ``n`` instances; ``send(i)`` announces instance i; ``silence``/``crash`` kill."""

    def __init__(self, n: int, interval_s: float) -> None:
        self.n = n
        self.interval_s = interval_s
        self.stopped: set[int] = set()
        self.sent = 0
        self.failed = 0
        self.rounds = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run_rounds(self, indices: list[int], send: Callable[[int], None], ready: threading.Event) -> None:
        """Announce ``indices`` once per interval, spread evenly, until :attr:`stop`."""
        while not self.stop.is_set():
            t0 = time.monotonic()
            for k, i in enumerate(indices):
                if self.stop.is_set():
                    return
                delay = t0 + k * self.interval_s / len(indices) - time.monotonic()
                if delay > 0.002:
                    self.stop.wait(delay)
                if i not in self.stopped:
                    send(i)
            ready.set()
            with self.lock:
                self.rounds += 1
            self.stop.wait(max(0.0, t0 + self.interval_s - time.monotonic()))

    def victims(self, k: int) -> list[int]:
        """``k`` running instances spread evenly over the round (so over every phase of it)."""
        running = [i for i in range(self.n) if i not in self.stopped]
        step = max(1, len(running) // max(1, k))
        return running[::step][:k]


class ZmqSim(Sim):
    def __init__(self, address: str, n: int, interval_s: float) -> None:
        super().__init__(n, interval_s)
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket | None] = []
        for _ in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.socks.append(sock)
        self.infos = [sim_info(i) for i in range(n)]
        self.seq = [0] * n
        self.rng = random.Random(1)

    def start(self) -> list[threading.Event]:
        ready = threading.Event()
        threading.Thread(target=self.run_rounds, args=(list(range(self.n)), self.send, ready),
                         daemon=True).start()
        return [ready]

    def send(self, i: int) -> None:
        sock = self.socks[i]
        if sock is None:
            return
        self.seq[i] += 1
        hb = Heartbeat(info=self.infos[i], load=random_load(self.rng), seq=self.seq[i], sent_at=time.time())
        try:
            sock.send_multipart(encode_frames(hb), flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.failed += 1

    def kill(self, ids: list[int], crash: bool) -> None:
        with self.lock:
            self.stopped.update(ids)
        if crash:
            for i in ids:
                sock, self.socks[i] = self.socks[i], None
                if sock is not None:
                    sock.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        time.sleep(0.05)  # let the sender thread leave its current send
        for sock in self.socks:
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()


class EtcdSim(Sim):
    def __init__(self, address: str, n: int, interval_s: float) -> None:
        super().__init__(n, interval_s)
        target = parse_discovery_address(address)
        self.regs = [
            EtcdRegistration(target, sim_info(i), _load_fn(random.Random(i)), interval_s,
                             min_put_interval_s=interval_s / 2)
            for i in range(n)
        ]

    def start(self) -> list[threading.Event]:
        events = []
        for w in range(ETCD_WORKERS):
            ready = threading.Event()
            threading.Thread(target=self.run_rounds, args=(list(range(w, self.n, ETCD_WORKERS)), self.send,
                                                           ready), daemon=True).start()
            events.append(ready)
        return events

    def send(self, i: int) -> None:
        reg = self.regs[i]
        before = reg.dropped
        reg.tick()
        with self.lock:
            if reg.dropped > before:
                self.failed += 1
            else:
                self.sent += 1

    def kill(self, ids: list[int], crash: bool) -> None:
        with self.lock:
            self.stopped.update(ids)
        if crash:
            for i in ids:
                self.regs[i].disconnect()

    def close(self) -> None:
        self.stop.set()
        time.sleep(0.05)
        for i, reg in enumerate(self.regs):  # revoke what is left (an external etcd stays clean)
            if i not in self.stopped:
                with contextlib.suppress(EtcdError):
                    reg.revoke()
            reg.disconnect()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR)  # lease churn under overload is counted, not logged
    backend, address, n, interval_s = argv[0], argv[1], int(argv[2]), float(argv[3])
    sim: ZmqSim | EtcdSim
    sim = ZmqSim(address, n, interval_s) if backend == "zmq" else EtcdSim(address, n, interval_s)
    try:
        for event in sim.start():
            if not event.wait(60 + 10 * interval_s):
                print("SIM_FAILED first round did not finish", flush=True)
                return 1
        print(f"SIM_READY {n}", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["kill"]:
                ids = sim.victims(int(words[2]))
                now = time.time()
                sim.kill(ids, crash=words[1] == "crash")
                print(f"KILLED {now:.6f} {','.join(sim_info(i).instance_id for i in ids)}", flush=True)
            elif words[:1] == ["stats"]:
                stats = {"sent": sim.sent, "failed": sim.failed, "rounds": sim.rounds}
                print(f"STATS {json.dumps(stats)}", flush=True)
            elif words[:1] == ["quit"]:
                break
    finally:
        sim.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
