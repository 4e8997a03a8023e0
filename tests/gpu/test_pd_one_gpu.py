"""P/D on ONE GPU with the built-in engine on its defaults (``--kv-transport auto``): P and D share
cuda:0, the agents negotiate the CUDA IPC plane (NCCL refuses two ranks on one device), and P's
blocks are copied straight into D's. Greedy output (fp32) equals a colocated engine token for token
with no recompute on D; a concurrent burst leaves no blocks held; P killed in the middle of a burst
ends every request (OK or a clear error, no hang) and a restarted P serves again with D unchanged;
D restarted likewise (P maps the new process's memory). Run on the GPU machine:
``pytest -m gpu tests/gpu/test_pd_one_gpu.py``."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from kvwire.cluster.local import LocalCluster
from kvwire.protocol.kv_params import Role, TransferMode
from support.pd_gpu import MAX_TOKENS, body, metric, pd_cluster, prompts_of, reference, send

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=[TransferMode.PUSH, TransferMode.PULL], ids=lambda m: m.value)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from pd_cluster(request.param, tmp_path_factory, "pd_one_gpu")


def _decode_url(cluster: LocalCluster) -> str:
    url = next(i.url for i in cluster.live_instances() if i.role is Role.DECODE)
    assert url is not None
    return url


def _blocks_drain(cluster: LocalCluster) -> None:
    for instance in cluster.live_instances():
        assert instance.url is not None
        deadline = time.monotonic() + 20
        while metric(instance.url, "kvwire_kv_blocks_in_use") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(instance.url, "kvwire_kv_blocks_in_use") == 0, instance.name


def _equal_to_colocated(cluster: LocalCluster, n: int) -> None:
    prompts = prompts_of(n)
    expected = reference(prompts)
    d_url = _decode_url(cluster)
    before = metric(d_url, "kvwire_pd_transfers_completed_total")
    skipped_before = metric(cluster.router_url, "kvwire_router_skipped_prefills_total")
    for i, prompt in enumerate(prompts):
        result = asyncio.run(send(cluster.router_url, [body(prompt, stream=bool(i % 2))]))[0]
        assert result.ok, result.error
        assert result.token_ids == expected[i], f"prompt {i} ({len(prompt)} tokens)"
    moved = metric(d_url, "kvwire_pd_transfers_completed_total") - before
    # kv_aware (the default policy) sends a short prompt whose prefix D already holds to D alone
    skipped = metric(cluster.router_url, "kvwire_router_skipped_prefills_total") - skipped_before
    assert moved >= 1 and moved + skipped >= len(prompts), (moved, skipped)
    assert metric(d_url, "kvwire_pd_load_failures_total") == 0  # nothing recomputed on D
    assert metric(d_url, 'kvwire_kv_peers{transport="ipc"}') >= 1
    p_url = next(i.url for i in cluster.live_instances() if i.role is Role.PREFILL)
    assert p_url is not None and metric(p_url, "kvwire_kv_device_copy_bytes_total") > 0  # P's copies


def test_pd_on_one_gpu_negotiates_ipc_and_equals_colocated(cluster: LocalCluster) -> None:
    _equal_to_colocated(cluster, 6)


def test_concurrent_burst_frees_every_block(cluster: LocalCluster) -> None:
    bodies = [body(p, stream=bool(i % 2)) for i, p in enumerate(prompts_of(48))]
    results = asyncio.run(send(cluster.router_url, bodies))
    assert all(r.ok and len(r.token_ids) == MAX_TOKENS for r in results), [r.error for r in results]
    _blocks_drain(cluster)


def test_prefill_killed_mid_burst_then_restarted(cluster: LocalCluster) -> None:
    async def burst_and_kill() -> list:
        bodies = [body(p, stream=bool(i % 2)) for i, p in enumerate(prompts_of(24))]
        task = asyncio.ensure_future(send(cluster.router_url, bodies))
        await asyncio.sleep(0.3)  # fault injection point, not synchronization: some in flight
        victim = next(i.name for i in cluster.live_instances() if i.role is Role.PREFILL)
        cluster.kill(victim, signal.SIGKILL)
        return list(await asyncio.wait_for(task, timeout=120))

    start = time.monotonic()
    results = asyncio.run(burst_and_kill())
    assert time.monotonic() - start < 120  # every request ended: no hang
    assert all(r.ok or r.error for r in results)  # OK, or a clear error
    cluster.start_instance("prefill-restarted", Role.PREFILL)
    cluster.wait_ready()
    _blocks_drain(cluster)
    _equal_to_colocated(cluster, 3)


def test_decode_restarted_new_epoch_is_mapped(cluster: LocalCluster) -> None:
    victim = next(i.name for i in cluster.live_instances() if i.role is Role.DECODE)
    cluster.kill(victim, signal.SIGKILL)
    cluster.start_instance(f"{victim}-restarted", Role.DECODE)
    deadline = time.monotonic() + 60
    while any(i.name == victim for i in cluster.live_instances()) and time.monotonic() < deadline:
        time.sleep(0.1)
    cluster.wait_ready()
    _equal_to_colocated(cluster, 3)
    _blocks_drain(cluster)
