"""P/D end to end through real processes (router + `kvwire serve` instances, TCP on loopback).

Greedy outputs of 1P1D and 2P2D clusters, push and pull, equal a colocated instance token for token
for 24 concurrent prompts (lengths 1, block-1, block, block+1, 3*block+5, near max; half streamed);
afterwards no instance holds KV blocks. Client aborts mid-handover release everything. Fault cases
live in test_pd_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.protocol.kv_params import TransferMode
from kvwire.transfer.enums import Transport
from support.pd_cluster_helpers import ColocatedServer, body, metric, prompts, running_cluster, send_all
from support.waiting import wait_for

pytestmark = pytest.mark.slow
KV_DEADLINE_S = 10.0  # push transfer deadline and pull lease

# KV moves over the plane P and D negotiate (shared memory: one host), and over forced TCP once.
TOPOLOGIES = [(1, 1, TransferMode.PUSH, Transport.AUTO), (1, 1, TransferMode.PULL, Transport.AUTO),
              (2, 2, TransferMode.PUSH, Transport.AUTO), (2, 2, TransferMode.PULL, Transport.TCP)]


def bodies() -> list[dict]:
    return [body(p, stream=(i % 2 == 1)) for i, p in enumerate(prompts())]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd_cluster")


@pytest.fixture(scope="module")
def reference(log_dir: Path) -> list[list[int]]:
    with open(log_dir / "reference.log", "w") as sink:
        server = ColocatedServer(sink)
        try:
            results = send_all(server.url, bodies())
        finally:
            server.stop()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return [r.token_ids for r in results]


@pytest.fixture(scope="module", params=TOPOLOGIES,
                ids=lambda t: f"{t[0]}P{t[1]}D-{t[2].value}-{t[3].value}")
def cluster(request: pytest.FixtureRequest, log_dir: Path) -> Iterator[LocalCluster]:
    num_p, num_d, mode, transport = request.param
    spec = ClusterSpec(num_prefill=num_p, num_decode=num_d, mode=mode, kv_deadline_s=KV_DEADLINE_S,
                       heartbeat_interval_s=0.5, kv_transport=transport)
    with running_cluster(spec, log_dir / f"cluster-{num_p}p{num_d}d-{mode.value}.log") as pd:
        yield pd
    assert all(i.process.poll() is not None for i in pd.instances.values())


def assert_no_blocks_held(cluster: LocalCluster, within_s: float = 15.0) -> None:
    for instance in cluster.live_instances():
        assert instance.url is not None
        # Both at once: blocks_in_use is the engine loop's stats snapshot (it can still read 0 from
        # before a burst the engine is busy with), the awaiting-send gauge is live.
        wait_for(lambda u=instance.url: metric(u, "kvwire_kv_blocks_in_use") == 0
                 and metric(u, "kvwire_pd_blocks_awaiting_send") == 0, within_s,
                 f"{instance.name} still holds KV blocks")


def test_outputs_equal_colocated(cluster: LocalCluster, reference: list[list[int]]) -> None:
    results = send_all(cluster.router_url, bodies())
    for i, (result, expected) in enumerate(zip(results, reference, strict=True)):
        assert result.ok, f"prompt {i}: {result.error}"
        assert result.token_ids == expected, f"prompt {i} ({len(prompts()[i])} tokens, stream={i % 2})"
    decode = [i for i in cluster.live_instances() if i.role == "decode"]
    loaded = sum(metric(i.url, "kvwire_pd_transfers_completed_total") for i in decode if i.url)
    assert loaded >= len(results)  # D really got the KV from P (no silent local recompute)
    failures = sum(metric(i.url, "kvwire_pd_load_failures_total") for i in decode if i.url)
    assert failures == 0
    assert_no_blocks_held(cluster)
    assert_kv_transport(cluster, "shm" if cluster.spec.kv_transport is Transport.AUTO else "tcp")


def test_push_grants_at_expect_once_the_pair_has_met(cluster: LocalCluster) -> None:
    """Decision 110, on the serving path: once a D has talked to a P (the requests before), D grants
    a new request's blocks when it expects the transfer, before P's Offer — push mode only (a pull
    carries D's grant in the Pull anyway), and only for blocks D does not hold yet (prompts no
    instance has seen here)."""
    decode = [i for i in cluster.live_instances() if i.role == "decode"]
    before = sum(metric(i.url, "kvwire_kv_early_grants_total") for i in decode if i.url)
    fresh = [[(11 * j + 29 * k + 5) % 250 + 1 for j in range(40 + 8 * k)] for k in range(4)]
    for prompt in fresh:  # one at a time: each pair has met before its next request
        [result] = send_all(cluster.router_url, [body(prompt, stream=False)])
        assert result.ok, result.error
    early = sum(metric(i.url, "kvwire_kv_early_grants_total") for i in decode if i.url) - before
    if cluster.spec.mode is TransferMode.PUSH:
        assert early >= 1
    else:
        assert early == 0


def assert_kv_transport(cluster: LocalCluster, want: str) -> None:
    """Every P/D pair that moved KV shows the plane in the instances' metrics and the router's
    /instances (heartbeat load): shm when negotiated on one host, tcp when forced."""
    for instance in cluster.live_instances():
        assert instance.url is not None
        assert metric(instance.url, f'kvwire_kv_peers{{transport="{want}"}}') >= 1, instance.name
        assert metric(instance.url, 'kvwire_kv_peers{transport="none"}') == 0
        with urllib.request.urlopen(f"{instance.url}/metrics", timeout=5) as resp:
            exposed = resp.read().decode()
        assert "kvwire_kv_device_copy_bytes_total 0.0" in exposed  # CPU planes copy nothing on a GPU
        assert "kvwire_kv_device_copy_batches_total 0.0" in exposed

    def reported() -> bool:
        with urllib.request.urlopen(f"{cluster.router_url}/instances", timeout=5) as resp:
            views = json.load(resp)
        live = [v for v in views if v["alive"]]
        return all(v["load"] and set(v["load"]["kv_transports"].values()) == {want} for v in live)

    wait_for(reported, 10.0, f"/instances shows kv_transports {want}")


async def _abort_after(url: str, payload: dict, delay_s: float) -> None:
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(f"{url}/v1/completions", json=payload))
        await asyncio.sleep(delay_s)
        task.cancel()  # the client goes away mid-request: router, P and D must all let go
        try:
            resp = await task
            resp.close()
        except asyncio.CancelledError:
            pass


async def _abort_many(url: str) -> None:
    long_prompt = prompts(6)[5][:900]
    payloads = [body(long_prompt, stream=bool(k % 2), max_tokens=64) for k in range(8)]
    await asyncio.gather(*(_abort_after(url, p, 0.01 * k) for k, p in enumerate(payloads)))


def test_client_aborts_mid_handover_release_blocks(cluster: LocalCluster, reference: list[list[int]]) -> None:
    asyncio.run(_abort_many(cluster.router_url))
    # Push: every side cancels at once. Pull: a lease whose D never came expires (by design).
    assert_no_blocks_held(cluster, within_s=15.0 + KV_DEADLINE_S)
    # Still serving, still exact.
    result = send_all(cluster.router_url, bodies()[:2])
    assert [r.token_ids for r in result] == reference[:2]
