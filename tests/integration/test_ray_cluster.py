"""``kvwire up --ray`` on a local two-node Ray cluster (CPU, one machine; decision 120).

Node 1 (the head) offers the custom resources ``pool_p`` and ``kvwire_router``, node 2 ``pool_d``: the
router and P land on node 1, D on node 2. The cluster is started through the CLI (``kvwire up --ray``,
a subprocess, ended with Ctrl-C at the end), scaled through ``kvwire scale`` and the Python API, and
inspected through :meth:`RayCluster.status`. In order: P/D output equals the colocated engine's on 20
prompts; under closed-loop load, a second D is added, the first one's ``kvwire serve`` is killed with
SIGKILL (Ray restarts it under the same id) and the second is removed (drained): 0 failed requests;
Ctrl-C leaves no kvwire process, actor or shared-memory name behind.

Ray binds loopback only: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes it use 127.0.0.1 as the node IP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvwire.cluster.client import post_completion
from kvwire.cluster.etcd import LocalEtcd, etcd_binary
from kvwire.cluster.process import ManagedProcess, kvwire_argv
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import Role
from support.leaks import orphaned, shm_names_mapped_by
from support.pd_cluster_helpers import body, metric, send_all
from support.waiting import wait_for

# Before Ray is imported (it reads this once): Ray then takes 127.0.0.1 as every node's IP, so it and
# every kvwire process it places bind loopback only.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
from kvwire.cluster.ray_cluster import RayCluster  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "t38"
MAX_TOKENS = 8


def prompt(i: int) -> list[int]:
    """Distinct first blocks (no prefix shared between prompts), lengths 5..53."""
    return [(11 * i + 3 * j) % 250 + 1 for j in range(5 + (i * 7) % 49)]


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = os.pathsep.join(  # Ray's workers import kvwire (cwd may differ)
        os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "src").split(os.pathsep) if p)
    common: dict[str, Any] = {"num_cpus": 4, "object_store_memory": 80 * 1024**2, "include_dashboard": False}
    nodes = Cluster(initialize_head=True,
                    head_node_args={**common, "resources": {"pool_p": 4, "kvwire_router": 1}})
    try:
        nodes.add_node(**common, resources={"pool_d": 4})
        yield str(nodes.address)
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def up(ray_address: str,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedProcess, RayCluster]]:
    """``kvwire up --ray`` (1P1D) as a subprocess, and a handle on it through the Python API."""
    log = open(tmp_path_factory.mktemp("ray") / "up.log", "w")  # noqa: SIM115 (closed below)
    argv = kvwire_argv("up", "--ray", ray_address, "--name", NAME, "--port", "0", "--prefill", "1",
                       "--decode", "1", "--prefill-resources", "pool_p=1", "--decode-resources", "pool_d=1",
                       "--router-resources", "kvwire_router=1", "--kv-deadline-s", "5",
                       "--drain-timeout-s", "30", "--start-timeout-s", "240")
    proc = ManagedProcess("up", argv, sink=log, sink_lock=threading.Lock())
    try:
        wait_for(lambda: "kvwire up: router" in proc.output() or proc.poll() is not None, 400,
                 "kvwire up --ray ready", interval_s=0.5)
        assert proc.poll() is None, proc.output()[-3000:]
        cluster = RayCluster.attach(NAME, ray_address)
        yield proc, cluster
        cluster.close()
    finally:
        proc.stop(60)
        log.close()


def processes(cluster: RayCluster) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = cluster.status()["processes"]
    return found


def test_placed_by_resources_and_pd_equals_colocated(up: tuple[ManagedProcess, RayCluster]) -> None:
    _, cluster = up
    procs = processes(cluster)
    assert set(procs) == {"router", "prefill-0", "decode-0"}
    assert {p["ip"] for p in procs.values()} == {"127.0.0.1"}
    assert cluster.router_url.startswith("http://127.0.0.1:")
    assert procs["prefill-0"]["node_id"] == procs["router"]["node_id"]  # pool_p and kvwire_router: head
    assert procs["decode-0"]["node_id"] != procs["prefill-0"]["node_id"]  # pool_d: the other node
    engine = LLMEngine(EngineConfig(model="tiny"))
    try:
        for i in range(20):
            engine.add_request(str(i), prompt(i), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                  ignore_eos=True))
        expected: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                expected[out.request_id] = list(out.token_ids)
    finally:
        engine.close()
    results = send_all(cluster.router_url, [body(prompt(i), stream=i % 2 == 0) for i in range(20)])
    assert [r.error for r in results if not r.ok] == []
    same = sum(r.token_ids == expected[str(i)] for i, r in enumerate(results))
    assert same == 20
    assert metric(_url(cluster, "decode-0"), "kvwire_pd_transfers_started_total") >= 20  # via P, then D


def _url(cluster: RayCluster, name: str) -> str:
    listed = {e["id"]: e["url"] for e in _instances(cluster)}
    return str(listed[name])


def _instances(cluster: RayCluster) -> list[dict[str, Any]]:
    from kvwire.cluster.local import http_json

    listed: list[dict[str, Any]] = http_json(f"{cluster.router_url}/instances")
    return listed


def _alive(cluster: RayCluster) -> set[str]:
    try:
        return {str(e["id"]) for e in _instances(cluster) if e.get("alive")}
    except OSError:
        return set()


class Load:
    """Closed-loop clients (half streaming) in a thread until :meth:`stop`; counts outcomes."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(url, clients)), daemon=True)
        self._thread.start()

    async def _run(self, url: str, clients: int) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._client(session, url, c) for c in range(clients)))

    async def _client(self, session: aiohttp.ClientSession, url: str, c: int) -> None:
        i = c
        while not self._stop.is_set():
            result = await post_completion(session, f"{url}/v1/completions",
                                           body(prompt(i), stream=c % 2 == 0), timeout_s=120)
            complete = result.ok and len(result.token_ids) == MAX_TOKENS
            if complete:
                self.ok += 1
            else:
                self.failed.append(f"{result.status} {(result.error or '')[:200]}")
            i += 4

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(180)
        assert not self._thread.is_alive(), "a client is still waiting for an answer"


def test_scale_up_kill_decode_and_drain_under_load(up: tuple[ManagedProcess, RayCluster],
                                                   ray_address: str) -> None:
    _, cluster = up
    load = Load(cluster.router_url)
    try:
        scale = ManagedProcess("scale", kvwire_argv("scale", "--ray", ray_address, "--name", NAME,
                                                    "--decode", "2"),
                               sink=sys.stderr, sink_lock=threading.Lock())
        assert scale.wait_exit(300) == 0, scale.output()[-3000:]
        procs = processes(cluster)
        assert procs["decode-1"]["node_id"] == procs["decode-0"]["node_id"]  # pool_d's node
        wait_for(lambda: metric(_url(cluster, "decode-1"), "kvwire_pd_transfers_started_total") > 0, 120,
                 "the new decode instance served", interval_s=0.5)
        kill_and_wait_back(cluster, load, "decode-0", "pid")  # its kvwire serve: the actor restarts
        kill_and_wait_back(cluster, load, "decode-1", "actor_pid")  # the actor: its child dies with it
        removed = processes(cluster)["decode-1"]
        cluster.scale(Role.DECODE, 1)
        assert "decode-1" not in processes(cluster)
        assert "decode-1" not in _alive(cluster)
        wait_for(lambda: not _pid_alive(removed["pid"]), 30, "the drained instance's process gone")
        ok_after_drain = load.ok
        wait_for(lambda: load.ok > ok_after_drain + 4, 120, "requests served after the drain", 0.5)
    finally:
        load.stop()
    assert load.failed == []
    assert load.ok > 20


def kill_and_wait_back(cluster: RayCluster, load: Load, name: str, which: str) -> None:
    """SIGKILL instance ``name``'s ``pid`` (kvwire serve) or ``actor_pid`` (its Ray actor); wait
    until Ray restarted it, it registered under the same id and the load got answers again."""
    victim = processes(cluster)[name]
    os.kill(victim[which], signal.SIGKILL)
    wait_for(lambda: not _pid_alive(victim["pid"]), 30, f"{name}'s kvwire serve gone")

    def back() -> bool:
        now = processes(cluster)[name]
        restarted = bool(now.get("alive")) and now.get("pid") != victim["pid"]
        return restarted and name in _alive(cluster)

    wait_for(back, 240, f"{name} restarted by Ray and registered again", interval_s=1.0)
    assert processes(cluster)[name]["restarted"] is True
    served = load.ok
    wait_for(lambda: load.ok > served + 4, 120, f"requests served after {name} came back", 0.5)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_router_comes_back_on_its_ports(up: tuple[ManagedProcess, RayCluster]) -> None:
    _, cluster = up
    router = processes(cluster)["router"]
    os.kill(router["pid"], signal.SIGKILL)

    def back() -> bool:
        now = processes(cluster)["router"]
        return bool(now.get("alive")) and now["pid"] != router["pid"] and _alive(cluster) == {
            "prefill-0", "decode-0"}

    wait_for(back, 240, "the router restarted on its ports, the instances registered again", 1.0)
    assert cluster.status()["router_url"] == cluster.router_url
    results = send_all(cluster.router_url, [body(prompt(i), stream=False) for i in range(4)])
    assert [r.error for r in results if not r.ok] == []


def test_ctrl_c_leaves_nothing_behind(up: tuple[ManagedProcess, RayCluster]) -> None:
    proc, cluster = up
    pids = [p[key] for p in processes(cluster).values() for key in ("pid", "actor_pid")]
    assert len(pids) == 6
    for change in ("decode-1 added", "decode-0 restarted", "router restarted", "decode-1 removed"):
        wait_for(lambda c=change: f"kvwire up: {c}" in proc.output(), 30, f"kvwire up reporting {change}")
    mapped = shm_names_mapped_by(pids)  # /dev/shm is host-wide: judge the names ours map
    proc.signal(signal.SIGINT)
    assert proc.wait_exit(180) == 0, proc.output()[-3000:]
    wait_for(lambda: not any(_pid_alive(pid) for pid in pids), 60, "every kvwire process and actor gone")
    named = ray.util.list_named_actors(all_namespaces=True)
    ours = [a for a in named if a["name"].startswith(f"kvwire-{NAME}")]
    assert ours == []
    groups = ray.util.placement_group_table().values()
    assert [g for g in groups if g["state"] != "REMOVED"] == []
    wait_for(lambda: not orphaned(mapped), 30, "no /dev/shm name of theirs left behind")


def test_killed_driver_takes_everything_with_it(ray_address: str, up: tuple[ManagedProcess, RayCluster]
                                                ) -> None:
    """``kill -9`` of ``kvwire up --ray`` itself (a colocated instance this time, found through etcd
    where the etcd binary is installed, as in CI): Ray ends the controller it owned, the controller's
    actors, and with them their children."""
    del up  # the first cluster is stopped: its resources are free
    etcd = LocalEtcd().start() if etcd_binary() is not None else None
    discovery = ("--discovery", f"{etcd.discovery}/{NAME}k") if etcd is not None else ()
    argv = kvwire_argv("up", "--ray", ray_address, "--name", f"{NAME}k", "--port", "0", "--prefill", "0",
                       "--decode", "0", "--both", "1", "--prefill-resources", "pool_p=1",
                       "--router-resources", "kvwire_router=1", "--start-timeout-s", "240", *discovery)
    proc = ManagedProcess("up-k", argv, sink=sys.stderr, sink_lock=threading.Lock())
    try:
        wait_for(lambda: "kvwire up: router" in proc.output() or proc.poll() is not None, 400,
                 "the second kvwire up --ray ready", interval_s=0.5)
        assert proc.poll() is None, proc.output()[-3000:]
        handle = RayCluster.attach(f"{NAME}k", ray_address)
        procs = processes(handle)
        handle.close()
        assert {p["role"] for p in procs.values()} == {"router", "both"}
        if etcd is not None:  # the instance registered in etcd, where the router found it
            assert handle.state["discovery"] == f"{etcd.discovery}/{NAME}k"
        assert send_all(str(handle.router_url), [body(prompt(1), stream=False)])[0].ok
        pids = [p[key] for p in procs.values() for key in ("pid", "actor_pid")]
        mapped = shm_names_mapped_by(pids)
        proc.signal(signal.SIGKILL)
        wait_for(lambda: not any(_pid_alive(pid) for pid in pids), 120, "every process of the cluster gone")
        wait_for(lambda: not orphaned(mapped), 30, "no /dev/shm name of theirs left behind")
    finally:
        proc.stop(30)
        if etcd is not None:
            etcd.stop()
