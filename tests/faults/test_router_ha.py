"""Router high availability and router death: an instance registers with two routers (``--router``
repeated); both route; SIGKILL of one leaves the other routing and the instances serving direct
requests; a router restarted on the same discovery port gets the instances back without their restart,
and the survivors are back to their thread / fd / shared-memory counts (tests/support/leaks.py)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster, free_port
from kvwire.cluster.process import ManagedProcess, kvwire_argv, wait_until
from support.fault_cluster import completion, http_ports, pids, post_json, running
from support.leaks import LeakBaseline

pytestmark = pytest.mark.slow


class SecondRouter:
    def __init__(self, discovery_port: int, http_port: int) -> None:
        self.url = f"http://127.0.0.1:{http_port}"
        self.discovery = f"tcp://127.0.0.1:{discovery_port}"
        argv = kvwire_argv("router", "--host", "127.0.0.1", "--port", str(http_port), "--discovery-host",
                           "127.0.0.1", "--discovery-port", str(discovery_port), "--instance-ttl-s", "2.0")
        self.process = ManagedProcess("router-b", argv, sink=sys.stderr, sink_lock=threading.Lock())


def _alive_ids(router_url: str) -> set[str]:
    try:
        with urllib.request.urlopen(router_url + "/instances", timeout=5) as resp:
            return {e["id"] for e in json.loads(resp.read()) if e["alive"]}
    except OSError:
        return set()


def _serves(url: str) -> bool:
    status, answer = post_json(url + "/v1/completions", completion(4, stream=False))
    return status == 200 and len(answer["choices"][0]["token_ids"]) == 4


@pytest.fixture()
def two_routers(tmp_path: Path) -> Iterator[tuple[LocalCluster, SecondRouter]]:
    spec = ClusterSpec(num_prefill=0, num_decode=0, num_both=1, heartbeat_interval_s=0.3,
                       instance_ttl_s=2.0)
    with running(spec, tmp_path / "ha.log") as cluster:
        b = SecondRouter(free_port("127.0.0.1"), free_port("127.0.0.1"))
        try:
            first = cluster.discovery_address
            cluster.discovery_address = f"{first},{b.discovery}"  # the next instance: both routers
            try:
                cluster.start_instance("both-ha", "both")
            finally:
                cluster.discovery_address = first
            cluster.wait_ready()
            yield cluster, b
        finally:
            b.process.stop(5.0)


def test_both_routers_route_and_one_dying_leaves_the_other(
    two_routers: tuple[LocalCluster, SecondRouter],
) -> None:
    cluster, b = two_routers
    assert wait_until(lambda: "both-ha" in _alive_ids(b.url), 15, interval_s=0.2)
    assert "both-ha" in _alive_ids(cluster.router_url)
    assert _serves(b.url) and _serves(cluster.router_url)
    url = cluster.instances["both-ha"].url
    # warm up as the test goes on (back-to-back requests, a direct one) before the counts are taken
    assert all(_serves(cluster.router_url) for _ in range(4)) and url is not None and _serves(url)
    baseline = LeakBaseline.take(pids(cluster), pooled_ports=http_ports(cluster))
    b.process.signal(signal.SIGKILL)
    b.process.wait_exit(10)
    assert all(_serves(cluster.router_url) for _ in range(4))  # router A keeps routing
    assert _serves(url)  # instances keep serving direct requests
    port = int(b.discovery.rsplit(":", 1)[1])
    restarted = SecondRouter(port, int(b.url.rsplit(":", 1)[1]))
    try:
        assert wait_until(lambda: "both-ha" in _alive_ids(restarted.url), 20, interval_s=0.2), \
            "the instance did not re-register with the restarted router"
        assert cluster.instances["both-ha"].process.poll() is None  # without a restart of its own
        assert _serves(restarted.url)
        baseline.wait_back(15)
    finally:
        restarted.process.stop(5.0)
