"""P/D on two GPUs with the built-in engine and the NCCL data plane: router + `kvwire serve` on
cuda (P on GPU 0, D on GPU 1). Sequential greedy requests (fp32) equal a colocated engine token for
token; a concurrent burst completes and leaves no KV blocks held. Run on the GPU machine:
``pytest -m gpu tests/gpu/test_pd_gpu.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from kvwire.cluster.local import LocalCluster
from kvwire.protocol.kv_params import TransferMode
from kvwire.transfer.enums import Transport
from support.pd_gpu import MAX_TOKENS, body, metric, pd_cluster, prompts_of, reference, send

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.fixture(scope="module", params=[TransferMode.PUSH, TransferMode.PULL], ids=lambda m: m.value)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from pd_cluster(
        request.param,
        tmp_path_factory,
        "pd_gpu",
        kv_transport=Transport.NCCL,  # this file tests the NCCL plane (auto picks IPC on one host)
        spread_gpus=2,
    )


def test_pd_over_nccl_equals_colocated(cluster: LocalCluster) -> None:
    prompts = prompts_of(6)
    expected = reference(prompts)
    for i, prompt in enumerate(prompts):
        result = asyncio.run(send(cluster.router_url, [body(prompt, stream=bool(i % 2))]))[0]
        assert result.ok, result.error
        assert result.token_ids == expected[i], f"prompt {i} ({len(prompt)} tokens)"
    d_url = cluster.instances["decode-0"].url
    assert d_url is not None
    assert metric(d_url, "kvwire_pd_transfers_completed_total") >= len(prompts)
    assert metric(d_url, "kvwire_pd_load_failures_total") == 0


def test_concurrent_burst_frees_every_block(cluster: LocalCluster) -> None:
    results = asyncio.run(
        send(cluster.router_url, [body(p, stream=bool(i % 2)) for i, p in enumerate(prompts_of(48))])
    )
    assert all(r.ok and len(r.token_ids) == MAX_TOKENS for r in results), [r.error for r in results]
    for instance in cluster.instances.values():
        assert instance.url is not None
        deadline = time.monotonic() + 20
        while metric(instance.url, "kvwire_kv_blocks_in_use") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(instance.url, "kvwire_kv_blocks_in_use") == 0, instance.name
