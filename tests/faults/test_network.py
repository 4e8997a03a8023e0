"""Network faults between an instance and the router's discovery port, through a userspace relay
(tests/support/fault_relay.py): a partition (blackhole) and connection resets take the instance out
of routing without losing a request; healed, it re-registers without a restart and every process
is back to its thread / fd / shared-memory counts (tests/support/leaks.py); a delay does nothing."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.cluster.process import wait_until
from support.fault_cluster import completion, http_ports, pids, post_json, running
from support.fault_relay import FaultRelay, Mode
from support.leaks import LeakBaseline

pytestmark = pytest.mark.slow
TTL_S = 2.0
Setup = tuple[LocalCluster, FaultRelay, LeakBaseline]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    spec = ClusterSpec(num_prefill=0, num_decode=0, num_both=1, heartbeat_interval_s=0.3,
                       instance_ttl_s=TTL_S)
    with running(spec, Path(tmp_path_factory.mktemp("net")) / "net.log") as cluster:
        host, port = cluster.discovery_address.removeprefix("tcp://").split(":")
        with FaultRelay(host, int(port)) as relay:
            direct = cluster.discovery_address
            cluster.discovery_address = f"tcp://{relay.address}"  # the next instance registers via the relay
            try:
                cluster.start_instance("both-x", "both")
            finally:
                cluster.discovery_address = direct
            cluster.wait_ready()
            _all_routed_ok(cluster)
            for instance in cluster.live_instances():
                assert instance.url is not None and _serves(instance.url)
            yield cluster, relay, LeakBaseline.take(pids(cluster), pooled_ports=http_ports(cluster))


def _alive(cluster: LocalCluster, name: str) -> bool:
    with urllib.request.urlopen(cluster.router_url + "/instances", timeout=5) as resp:
        return any(e["id"] == name and e["alive"] for e in json.loads(resp.read()))


def _serves(url: str) -> bool:
    status, answer = post_json(url + "/v1/completions", completion(4, stream=False))
    return status == 200 and len(answer["choices"][0]["token_ids"]) == 4


def _all_routed_ok(cluster: LocalCluster, n: int = 4) -> bool:
    return all(_serves(cluster.router_url) for _ in range(n))


@pytest.mark.parametrize("fault", [Mode.BLACKHOLE, Mode.RESET])
def test_partitioned_instance_leaves_routing_and_comes_back(setup: Setup, fault: Mode) -> None:
    cluster, relay, baseline = setup
    assert _alive(cluster, "both-x")
    relay.set_mode(fault)
    assert wait_until(lambda: not _alive(cluster, "both-x"), TTL_S + 5, interval_s=0.1)
    assert _all_routed_ok(cluster)  # the other instance serves everything
    x_url = cluster.instances["both-x"].url
    assert x_url is not None and _serves(x_url)  # the partitioned instance still serves direct requests
    relay.set_mode(Mode.PASS)
    assert wait_until(lambda: _alive(cluster, "both-x"), 20, interval_s=0.2), "did not re-register"
    assert cluster.instances["both-x"].process.poll() is None  # no restart was needed
    assert _all_routed_ok(cluster)
    baseline.wait_back(15)


def test_delay_below_the_ttl_changes_nothing(setup: Setup) -> None:
    cluster, relay, _ = setup
    relay.delay_s = 0.4
    try:
        assert not wait_until(lambda: not _alive(cluster, "both-x"), TTL_S * 2, interval_s=0.1)
    finally:
        relay.delay_s = 0.0
