"""etcd discovery with a real etcd: several routers, one cluster; deaths; etcd itself restarted.

Needs the ``etcd`` binary (``scripts/test.sh`` installs it through ``scripts/install_etcd.sh``); the
module is skipped, saying so, only where it is missing. Mocks heartbeat every 0.5 s, so their lease
TTL is 2 s (3 intervals, whole seconds, etcd's minimum).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.etcd import INSTALL_HINT, LocalEtcd, etcd_binary
from kvwire.cluster.local import ClusterSpec, http_json
from support.mock_instance import MockProcess, RouterThread, get, get_raw, post, router_config
from support.pd_cluster_helpers import body, metric, running_cluster, send_all
from support.waiting import wait_for

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=f"etcd binary not installed: {INSTALL_HINT}")

TTL_S = 2.0  # lease TTL of a mock heartbeating every 0.5 s
BODY = {"model": "mock", "prompt": "hi", "max_tokens": 2}


def alive(router: RouterThread) -> set[str]:
    return {e["id"] for e in get(router.url, "/instances") if e["alive"]}


def stale_metric(router: RouterThread) -> float:
    for line in get_raw(router.url, "/metrics")[1].decode().splitlines():
        if line.startswith("kvwire_router_discovery_stale "):
            return float(line.split()[1])
    raise AssertionError("kvwire_router_discovery_stale missing from /metrics")


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def mock(etcd: LocalEtcd, ident: str) -> MockProcess:
    return MockProcess(etcd.discovery, ident, "--role", "both", "--interval-s", "0.5")


def removed_within(routers: list[RouterThread], ident: str, t0: float, limit_s: float) -> float:
    for router in routers:
        wait_for(lambda r=router: ident not in alive(r), limit_s + 2.0, f"{ident} removed")
    took = time.monotonic() - t0
    assert took <= limit_s, f"{ident} left the routers' view after {took:.2f} s (limit {limit_s} s)"
    return took


def test_several_routers_one_cluster_and_deaths(etcd: LocalEtcd) -> None:
    routers = [RouterThread(router_config(discovery=etcd.discovery)) for _ in range(2)]
    mocks = {ident: mock(etcd, ident) for ident in ("m0", "m1", "m2")}
    try:
        for router in routers:
            wait_for(lambda r=router: alive(r) == set(mocks), 10, "every router sees every mock")
            assert post(router.url, "/v1/completions", BODY)[0] == 200
        # kill -9: the keep-alives stop; etcd expires the lease; every router drops it within the TTL.
        t0 = time.monotonic()
        mocks["m0"].kill()
        removed_within(routers, "m0", t0, TTL_S + 1.0)
        # SIGSTOP: the process is there, its connections open, but it renews nothing: same.
        mocks["m1"].proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        removed_within(routers, "m1", t0, TTL_S + 1.0)
        # SIGCONT: it finds its lease gone, takes a new one and is back in every router.
        mocks["m1"].proc.send_signal(signal.SIGCONT)
        for router in routers:
            wait_for(lambda r=router: "m1" in alive(r), 5, "m1 back after SIGCONT")
        # Graceful stop revokes the lease: gone at once (well under the TTL).
        t0 = time.monotonic()
        mocks["m2"].stop()
        removed_within(routers, "m2", t0, 1.0)
        # One router gone: the other keeps routing.
        routers[0].close()
        assert post(routers[1].url, "/v1/completions", BODY)[0] == 200
        assert alive(routers[1]) == {"m1"}
    finally:
        for m in mocks.values():
            m.kill()
        for router in routers:
            router.close()


def test_etcd_restart_routes_on_last_view_then_resyncs(etcd: LocalEtcd) -> None:
    routers = [RouterThread(router_config(discovery=etcd.discovery)) for _ in range(2)]
    mocks = {ident: mock(etcd, ident) for ident in ("m0", "m1")}
    try:
        for router in routers:
            wait_for(lambda r=router: alive(r) == set(mocks), 10, "every router sees every mock")
            assert stale_metric(router) == 0.0
        etcd.kill()
        for router in routers:
            wait_for(lambda r=router: all(e["discovery_stale"] for e in get(r.url, "/instances")), 5,
                     "view marked stale")
            assert stale_metric(router) == 1.0
            health = get(router.url, "/health")["discovery"]
            assert (health["backend"], health["stale"]) == ("etcd", True) and health["error"]  # why
            # The last view still routes, past the lease TTL.
        time.sleep(TTL_S + 0.5)  # let the lease TTL pass with etcd down (not synchronization)
        for router in routers:
            assert alive(router) == set(mocks)
            assert post(router.url, "/v1/completions", BODY)[0] == 200
        # etcd back with its data lost: the instances must take new leases and put their records again.
        etcd.wipe()
        etcd.start()
        for router in routers:
            wait_for(lambda r=router: stale_metric(r) == 0.0 and alive(r) == set(mocks), 15,
                     "routers resynced with every mock re-registered")
        late = mock(etcd, "m2")
        mocks["m2"] = late
        for router in routers:
            wait_for(lambda r=router: "m2" in alive(r), 5, "an instance registered after the restart")
    finally:
        for m in mocks.values():
            m.kill()
        for router in routers:
            router.close()


def test_kvwire_up_with_etcd_serves_pd(tmp_path: Path) -> None:
    """`kvwire up --discovery etcd`'s cluster: a local etcd, `kvwire serve --router etcd://...` P and D
    (built-in engine, tiny model), the router watching etcd; one P/D request end to end."""
    spec = ClusterSpec(num_prefill=1, num_decode=1, discovery="etcd", heartbeat_interval_s=0.5)
    with running_cluster(spec, tmp_path / "cluster.log") as cluster:
        assert cluster.discovery_address.startswith("etcd://127.0.0.1:")
        listed = {e["id"]: e for e in http_json(f"{cluster.router_url}/instances")}
        assert set(listed) == {"prefill-0", "decode-0"}
        assert listed["decode-0"]["kv_endpoints"] and listed["decode-0"]["load"] is not None
        result = send_all(cluster.router_url, [body([1, 2, 3, 4], stream=False)])[0]
        assert result.ok, result
        decode_url = cluster.instances["decode-0"].url
        assert decode_url is not None
        assert metric(decode_url, "kvwire_pd_transfers_completed_total") == 1  # really P/D
        etcd = cluster.etcd
    assert etcd is not None and etcd.process is None  # stopped with the cluster


def test_router_expires_an_overdue_record_before_etcd_drops_its_lease(etcd: LocalEtcd) -> None:
    """The router takes an instance out of routing when the record it promised is overdue, without
    waiting for etcd to expire its lease (here 10 s, so etcd cannot be the one); a stalled etcd
    expires nobody; the next record brings the instance back."""
    import asyncio

    from kvwire.discovery import InstanceInfo, parse_discovery_address
    from kvwire.discovery.etcd_gateway import EtcdHttp, encode_record
    from kvwire.discovery.heartbeats import Heartbeat
    from kvwire.protocol.kv_params import Role
    from kvwire.router.discovery_backend import EtcdDiscovery
    from kvwire.router.registry import InstanceState, Registry

    target = parse_discovery_address(etcd.discovery)
    quiet = InstanceInfo(instance_id="quiet", role=Role.DECODE, url="http://127.0.0.1:9", model="m")
    http = EtcdHttp(target.address, timeout_s=3.0)
    lease = http.grant(10)
    assert etcd.process is not None

    def put(seq: int) -> float:
        http.put(target.key("quiet"), encode_record(Heartbeat(info=quiet, seq=seq, ttl_s=1.0)), lease)
        return time.monotonic()

    async def until(predicate, limit_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        while not predicate():
            assert time.monotonic() - t0 < limit_s, what
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    async def scenario() -> None:
        registry = Registry(ttl_s=100.0)
        watcher = EtcdDiscovery(registry, target)
        await watcher.start()
        try:
            await until(lambda: not watcher.stale, 10, "watching")
            t_put = await asyncio.to_thread(put, 1)
            await until(lambda: registry.get("quiet") is not None, 5, "registered")
            etcd.process.signal(signal.SIGSTOP)  # type: ignore[union-attr]  # a stalled etcd...
            try:
                t_end = time.monotonic() + 2.5
                while time.monotonic() < t_end:  # ...is no reason to expire anyone
                    view = registry.get("quiet")
                    assert view is not None and view.alive, "expired while etcd was stalled"
                    await asyncio.sleep(0.05)
            finally:
                etcd.process.signal(signal.SIGCONT)  # type: ignore[union-attr]
            # etcd answers again and confirms the quiet watch is current: out, long before the lease
            await until(lambda: not registry.get("quiet").alive, 3.0, "overdue record expired")  # type: ignore[union-attr]
            view = registry.get("quiet")
            assert view is not None and view.state is InstanceState.EXPIRED
            assert time.monotonic() - t_put < 8.0 and watcher.probes["expired"] >= 1
            t_put = await asyncio.to_thread(put, 2)
            await until(lambda: registry.get("quiet").alive, 5, "back with its next record")  # type: ignore[union-attr]
            took = await until(lambda: not registry.get("quiet").alive, 3.0, "expired again")  # type: ignore[union-attr]
            assert 0.8 <= time.monotonic() - t_put <= 1.6, took  # its TTL (1 s), not the lease's 10 s
        finally:
            await watcher.stop()

    try:
        asyncio.run(scenario())
    finally:
        http.revoke(lease)
        http.close()
