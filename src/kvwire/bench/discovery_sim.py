"""N simulated instances in one process, for ``kvwire bench discovery`` (no engine, no HTTP).

Run by the benchmark as ``python -m kvwire.bench.discovery_sim BACKEND ADDRESS N INTERVAL_S``.
Instance ``i`` is a prefill (even ``i``) or decode (odd) instance of model ``sim`` with its own URL
and KV endpoint. Each one announces itself every ``INTERVAL_S`` with a new load, the rounds spread
evenly over the interval:

* ``zmq``: one ZeroMQ PUSH socket (its own TCP connection) per instance, the messages built and
  signed by the same :func:`~kvwire.discovery.heartbeats.encode_frames` the real client uses.
* ``etcd``: one lease and one key per instance, as :class:`~kvwire.discovery.etcd_client.EtcdRegistration`
  keeps them: each round renews the lease and puts the record with a new load (the record promising
  the next within the lease TTL). The calls are
  batched by groups of 10 instances (one keep-alive request, one put transaction per group);
  see :class:`EtcdSim`.

Commands on stdin, answers on stdout: ``kill silent K`` (K running instances, spread over the round,
stop sending but keep their connections: a SIGSTOPped or cut-off instance) and ``kill crash K``
(likewise, but their connections are
closed as a kill -9 would) answer ``KILLED <wall time> <ids,...>``; ``stats`` answers
``STATS <json>``; ``last_sent ID,...`` answers ``LAST_SENT <json>`` (wall time each one's last
announcement left); ``quit`` (or stdin closed) stops everything. ``SIM_READY`` is printed after the
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
from kvwire.discovery.etcd_client import lease_ttl_for
from kvwire.discovery.etcd_gateway import EtcdError, EtcdHttp, encode_record
from kvwire.discovery.heartbeats import Heartbeat, InstanceInfo, InstanceLoad, encode_frames
from kvwire.protocol.kv_params import Role

MODEL = "sim"
ETCD_WORKERS = 32  # threads sending the groups' calls (blocking HTTP: they wait on etcd)
ETCD_GROUP = 10  # instances per keep-alive request and per put transaction


def sim_info(i: int) -> InstanceInfo:
    role = Role.PREFILL if i % 2 == 0 else Role.DECODE
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
        # per instance: wall time its last announcement left (the kill can land while one of its
        # calls is under way: that record still arrives, and the instance was alive when it left)
        self.last_sent = [0.0] * n
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run_rounds(self, indices: list[int], send: Callable[[int], None], ready: threading.Event) -> None:
        """Call ``send`` for each of ``indices`` (instances, or groups of them) once per interval,
        spread evenly, until :attr:`stop`."""
        while not self.stop.is_set():
            t0 = time.monotonic()
            for k, i in enumerate(indices):
                if self.stop.is_set():
                    return
                delay = t0 + k * self.interval_s / len(indices) - time.monotonic()
                if delay > 0.002:
                    self.stop.wait(delay)
                send(i)  # each send skips what was killed
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
        if sock is None or i in self.stopped:
            return
        self.seq[i] += 1
        hb = Heartbeat(info=self.infos[i], load=random_load(self.rng), seq=self.seq[i], sent_at=time.time())
        self.last_sent[i] = hb.sent_at
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
    """Instances in groups of :data:`ETCD_GROUP`: one gateway request renews a group's leases, one
    transaction puts their records (each bound to its own lease). Real instances make one call per
    lease and per put; batching here keeps 1,000 instances within what this process and etcd can
    send on a small machine. The router sees the same records, deletions and event rate."""

    def __init__(self, address: str, n: int, interval_s: float) -> None:
        super().__init__(n, interval_s)
        self.target = parse_discovery_address(address)
        self.ssl = self.target.ssl_context()
        self.infos = [sim_info(i) for i in range(n)]
        self.leases = [0] * n
        self.seq = [0] * n
        self.ttl = lease_ttl_for(interval_s)
        self.rng = random.Random(1)
        self.groups = [list(range(g, min(n, g + ETCD_GROUP))) for g in range(0, n, ETCD_GROUP)]
        self.clients: list[EtcdHttp] = []
        self.regrants = 0
        self._local = threading.local()

    def start(self) -> list[threading.Event]:
        events = []
        workers = min(ETCD_WORKERS, len(self.groups))
        for w in range(workers):
            ready = threading.Event()
            mine = list(range(w, len(self.groups), workers))
            threading.Thread(target=self.run_rounds, args=(mine, self.send, ready), daemon=True).start()
            events.append(ready)
        return events

    def _http(self) -> EtcdHttp:
        client: EtcdHttp | None = getattr(self._local, "client", None)
        if client is None:
            client = EtcdHttp(self.target.address, timeout_s=5.0, ssl_context=self.ssl, auth=self.target.auth)
            self._local.client = client
            with self.lock:
                self.clients.append(client)
        return client

    def send(self, g: int) -> None:
        """One round of group ``g``: renew (or grant) its leases, then put its records."""
        ids = [i for i in self.groups[g] if i not in self.stopped]
        if not ids:
            return
        http = self._http()
        try:
            held = [i for i in ids if self.leases[i]]
            if held:
                ttls = http.keepalive_many([self.leases[i] for i in held])
                for i, ttl in zip(held, ttls, strict=True):
                    if ttl <= 0:  # lost (expired while this process was late): register again
                        self.leases[i] = 0
                        self.regrants += 1
            for i in ids:
                if not self.leases[i]:
                    self.leases[i] = http.grant(self.ttl)
            ids = [i for i in ids if i not in self.stopped]  # killed during the keep-alive: no record
            items = []
            sent = time.time()
            for i in ids:
                self.seq[i] += 1
                hb = Heartbeat(info=self.infos[i], load=random_load(self.rng), seq=self.seq[i],
                               sent_at=sent, ttl_s=float(self.ttl))
                items.append((self.target.key(self.infos[i].instance_id), encode_record(hb), self.leases[i]))
                self.last_sent[i] = sent
            if items:
                http.put_many(items)
        except EtcdError:
            with self.lock:
                self.failed += len(ids)
            return
        with self.lock:
            self.sent += len(ids)

    def kill(self, ids: list[int], crash: bool) -> None:
        with self.lock:  # no connection of their own to close: crash and silent are the same here
            self.stopped.update(ids)

    def close(self) -> None:
        self.stop.set()
        time.sleep(0.05)
        http = EtcdHttp(self.target.address, timeout_s=5.0, ssl_context=self.ssl, auth=self.target.auth)
        for i, lease in enumerate(self.leases):  # revoke what is left (an external etcd stays clean)
            if lease and i not in self.stopped:
                with contextlib.suppress(EtcdError):
                    http.revoke(lease)
        http.close()
        for client in self.clients:
            client.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR)  # lease churn under overload is counted, not logged
    backend, address, n, interval_s = argv[0], argv[1], int(argv[2]), float(argv[3])
    sim: ZmqSim | EtcdSim
    sim = ZmqSim(address, n, interval_s) if backend == "zmq" else EtcdSim(address, n, interval_s)
    try:
        deadline = time.monotonic() + 60 + 10 * interval_s
        for event in sim.start():
            if not event.wait(max(0.0, deadline - time.monotonic())):
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
            elif words[:1] == ["last_sent"]:
                ids = [int(x.rsplit("-", 1)[1]) for x in words[1].split(",")]
                out = {sim_info(i).instance_id: sim.last_sent[i] for i in ids}
                print(f"LAST_SENT {json.dumps(out)}", flush=True)
            elif words[:1] == ["stats"]:
                stats = {"sent": sim.sent, "failed": sim.failed, "rounds": sim.rounds,
                         "regrants": getattr(sim, "regrants", 0)}
                print(f"STATS {json.dumps(stats)}", flush=True)
            elif words[:1] == ["quit"]:
                break
    finally:
        sim.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
