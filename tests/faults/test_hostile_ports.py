"""Hostile bytes on every port a default 1P1D cluster opens (issue 33, decision 113).

Router + prefill + decode, tiny model, CPU, default settings (the planes are TCP and shared memory:
one host). Every listening end of every process is found from /proc (tests/support/hostile_wire.py):
the router's HTTP and discovery ports, each instance's HTTP port, transfer control port, TCP data
plane and shared-memory socket. Each gets a corpus: the fuzzing tier's real messages mutated, a 60 KB
nesting bomb, 16 MiB frames, truncated and bad hellos, unsolicited and lying data frames, garbage, raw
HTTP with nested/huge/undecodable bodies and huge headers, slow senders and half-open connections.

Afterwards both instances are still listed (each sent a heartbeat the router took after the attack),
20 of 20 requests equal a colocated instance's output token for token (greedy, half streamed), no KV
block is held, and router, P and D are back to their thread / fd / shared-memory counts
(tests/support/leaks.py). Test_hostile_input.py keeps the per-message refusal counts; this one is
about surviving everything at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq

from kvwire.cluster.client import post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.cluster.process import wait_until
from support import hostile_wire as hw
from support.fault_cluster import blocks_back_to_zero, http_ports, pids, running
from support.leaks import LeakBaseline, footprint

pytestmark = pytest.mark.slow
REQUESTS = 20
LENGTHS = (1, 15, 16, 17, 53, 200, 600)  # prompt tokens: around a block (16), several blocks, long
HEARTBEAT_DEADLINE_S = 60.0
LEAK_DEADLINE_S = 60.0


def _bodies() -> list[dict[str, Any]]:
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(REQUESTS)]
    prompts = [[(7 * j + 13 * i) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    return [{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
             "stream": i % 2 == 1, "return_token_ids": True} for i, p in enumerate(prompts)]


def _outputs(router_url: str) -> list[list[int]]:
    async def send() -> list[Any]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(post_completion(session, f"{router_url}/v1/completions", b,
                                                          timeout_s=180) for b in _bodies()))

    results = asyncio.run(send())
    failed = [(i, r.status, r.error) for i, r in enumerate(results) if not r.ok]
    assert not failed, failed
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("hostile_ports"))


@pytest.fixture(scope="module")
def reference(log_dir: Path) -> list[list[int]]:
    """The same requests on one colocated instance (no KV transfer)."""
    with running(ClusterSpec(num_prefill=0, num_decode=0, num_both=1), log_dir / "colocated.log") as solo:
        return _outputs(solo.router_url)


@pytest.fixture(scope="module")
def cluster(log_dir: Path, reference: list[list[int]]) -> Iterator[LocalCluster]:
    with running(ClusterSpec(), log_dir / "pd.log") as pd:
        assert _outputs(pd.router_url) == reference  # warm, and the premise of every test here
        yield pd


@pytest.fixture()
def baseline(cluster: LocalCluster) -> LeakBaseline:
    return LeakBaseline.take(pids(cluster), pooled_ports=http_ports(cluster))


@dataclasses.dataclass(frozen=True)
class Ends:
    """Every listening end of the cluster, by what it speaks."""

    http: list[int]
    discovery: str  # the router's ZeroMQ PULL endpoint
    control: list[str]  # each instance's ZeroMQ ROUTER endpoint
    data: list[int | str]  # TCP data planes (ports) and shared-memory planes (abstract names)
    other_tcp: list[int]  # anything else listening (garbage only)

    @property
    def every_tcp(self) -> list[int]:
        zmq_ports = [int(e.rsplit(":", 1)[1]) for e in (self.discovery, *self.control)]
        return [*self.http, *zmq_ports, *(a for a in self.data if isinstance(a, int)), *self.other_tcp]


def _instances(cluster: LocalCluster) -> list[dict[str, Any]]:
    with urllib.request.urlopen(cluster.router_url + "/instances", timeout=10) as resp:
        found: list[dict[str, Any]] = json.loads(resp.read())
    return found


def find_ends(cluster: LocalCluster) -> Ends:
    assert cluster.router is not None
    router_port = int(cluster.router_url.rsplit(":", 1)[1])
    discovery_port = int(cluster.discovery_address.rsplit(":", 1)[1])
    http, control, data = [router_port], [], []
    other = sorted(hw.listening(cluster.router.pid).tcp_ports - {router_port, discovery_port})
    by_id = {e["id"]: e for e in _instances(cluster)}
    for instance in cluster.live_instances():
        assert instance.url is not None
        ends = hw.listening(instance.process.pid)
        port = int(instance.url.rsplit(":", 1)[1])
        endpoint = by_id[instance.name]["kv_endpoints"][0]
        http.append(port)
        control.append(endpoint)
        data += sorted(ends.tcp_ports - {port, int(endpoint.rsplit(":", 1)[1])})
        data += sorted(ends.unix_names)
    return Ends(http, cluster.discovery_address, control, data, other)


def _fresh_heartbeats(cluster: LocalCluster, since: float) -> bool:
    """Both instances listed and alive, each with a heartbeat the router took after ``since``."""
    def fresh() -> bool:
        entries = _instances(cluster)
        ago_s = time.monotonic() - since
        return len(entries) == 2 and all(e["alive"] and e["last_seen_s"] < ago_s for e in entries)
    return wait_until(fresh, HEARTBEAT_DEADLINE_S, interval_s=0.2)


def _still_serving(cluster: LocalCluster, reference: list[list[int]], since: float,
                   baseline: LeakBaseline) -> None:
    assert _fresh_heartbeats(cluster, since), f"instances after the attack: {_instances(cluster)}"
    outputs = _outputs(cluster.router_url)
    differ = [i for i, (got, want) in enumerate(zip(outputs, reference, strict=True)) if got != want]
    assert differ == [], f"{len(differ)} of {REQUESTS} outputs differ from the colocated instance"
    assert blocks_back_to_zero(cluster, 30)
    baseline.wait_back(LEAK_DEADLINE_S)


def test_every_port_is_found(cluster: LocalCluster) -> None:
    ends = find_ends(cluster)
    assert len(ends.http) == 3 and len(ends.control) == 2
    tcp_planes = [a for a in ends.data if isinstance(a, int)]
    shm_planes = [a for a in ends.data if isinstance(a, str) and a.startswith("@kvwire-shm-")]
    assert len(tcp_planes) == 2 and len(shm_planes) == 2, ends  # the defaults: TCP and shm on each


def test_hostile_frames_on_every_port(cluster: LocalCluster, reference: list[list[int]],
                                      baseline: LeakBaseline) -> None:
    ends = find_ends(cluster)
    hw.send_zmq(ends.discovery, zmq.PUSH, hw.discovery_cases())
    for endpoint, peer in zip(ends.control, reversed(ends.control), strict=True):
        hw.send_zmq(endpoint, zmq.DEALER, hw.control_cases(peer))
    for port in ends.every_tcp:
        for payload in hw.garbage_streams():
            hw.send_and_close(port, payload)
    for address in ends.data:
        shm = isinstance(address, str)
        for payload in hw.garbage_streams():
            hw.send_and_close(address, payload)
        for hello in hw.hello_cases(shm):
            hw.hello_session(address, hello)
        for frames in hw.data_plane_cases(shm):
            hw.data_plane_session(address, frames)
    for port in ends.http:
        for request in hw.http_raw_cases():
            hw.send_and_close(port, request)
    _still_serving(cluster, reference, time.monotonic(), baseline)


def test_slow_senders_and_half_open_connections_do_not_stop_serving(
    cluster: LocalCluster, reference: list[list[int]], baseline: LeakBaseline
) -> None:
    """While HTTP ports hold slow-loris requests and every other port half-open connections, the
    cluster serves; once they are gone, nothing of them is left."""
    ends = find_ends(cluster)
    zmq_ports = [int(e.rsplit(":", 1)[1]) for e in (ends.discovery, *ends.control)]
    with hw.held_open(list(ends.http), 8, hw.SLOW_HEAD), hw.held_open([*zmq_ports, *ends.data], 8):
        outputs = _outputs(cluster.router_url)
    assert outputs == reference
    _still_serving(cluster, reference, time.monotonic(), baseline)


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_stalled_data_plane_handshakes_are_closed(cluster: LocalCluster, plane: str) -> None:
    """A connection that never finishes its hello is closed by the plane (its handshake timeout)."""
    ends = find_ends(cluster)
    addresses = [a for a in ends.data if isinstance(a, int) == (plane == "tcp")]
    with hw.held_open(addresses, 2, b"KV") as socks:
        assert all(hw.closed_by_peer(sock, 60.0) for sock in socks)


def test_stalled_http_request_heads_are_closed(cluster: LocalCluster) -> None:
    """Router and instances close a connection whose request head does not complete in time."""
    ends = find_ends(cluster)
    with hw.held_open(ends.http, 1, hw.SLOW_HEAD) as socks:
        assert all(hw.closed_by_peer(sock, 90.0) for sock in socks)


def test_connection_flood_on_data_planes_is_capped(cluster: LocalCluster) -> None:
    """300 unauthenticated connections on each data plane of an instance cost it a bounded number
    of threads (a cap per listener), not one each."""
    ends = find_ends(cluster)
    instance = next(iter(cluster.live_instances()))
    mine = hw.listening(instance.process.pid)
    planes = [a for a in ends.data if a in mine.tcp_ports or a in mine.unix_names]
    before = footprint(instance.process.pid).threads
    with hw.held_open(planes, 300):
        during = footprint(instance.process.pid).threads
    assert during - before <= 128, f"{during - before} threads for {300 * len(planes)} connections"
