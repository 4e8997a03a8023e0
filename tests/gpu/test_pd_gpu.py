"""P/D on two GPUs with the built-in engine and the NCCL data plane: router + `kvwire serve` on
cuda (P on GPU 0, D on GPU 1). Sequential greedy requests (fp32) equal a colocated engine token for
token; a concurrent burst completes and leaves no KV blocks held. Run on the GPU machine:
``pytest -m gpu tests/gpu/test_pd_gpu.py``."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.kv_params import TransferMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
LENGTHS = (1, 15, 16, 17, 53, 1015)
MAX_TOKENS = 8


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * j + 13 * i) % 250 + 1 for j in range(LENGTHS[i % len(LENGTHS)])] for i in range(n)]


def _body(prompt: list[int], stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


async def _send(url: str, bodies: list[dict]) -> list[RequestResult]:
    async with aiohttp.ClientSession() as session:
        calls = [post_completion(session, f"{url}/v1/completions", b, timeout_s=120) for b in bodies]
        return list(await asyncio.gather(*calls))


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def _reference(prompts: list[list[int]]) -> list[list[int]]:
    from kvwire.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_kv_blocks=512))
    out = []
    for i, prompt in enumerate(prompts):  # one at a time: the same kernels as P's lone prefill
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out.append(o.token_ids)
    engine.close()
    return out


@pytest.fixture(scope="module", params=[TransferMode.PUSH, TransferMode.PULL], ids=lambda m: m.value)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_prefill=1, num_decode=1, device="cuda", mode=request.param, spread_gpus=2,
                       serve_args=("--dtype", "float32", "--num-kv-blocks", "4096"), start_timeout_s=300)
    log = tmp_path_factory.mktemp("pd_gpu") / f"cluster-{request.param.value}.log"
    with open(log, "w") as sink, LocalCluster(spec, sink=sink) as pd:
        yield pd
    print(Path(log).read_text()[-3000:])


def test_pd_over_nccl_equals_colocated(cluster: LocalCluster) -> None:
    prompts = _prompts(6)
    expected = _reference(prompts)
    for i, prompt in enumerate(prompts):
        result = asyncio.run(_send(cluster.router_url, [_body(prompt, stream=bool(i % 2))]))[0]
        assert result.ok, result.error
        assert result.token_ids == expected[i], f"prompt {i} ({len(prompt)} tokens)"
    d_url = cluster.instances["decode-0"].url
    assert d_url is not None
    assert _metric(d_url, "kvwire_pd_transfers_completed_total") >= len(prompts)
    assert _metric(d_url, "kvwire_pd_load_failures_total") == 0


def test_concurrent_burst_frees_every_block(cluster: LocalCluster) -> None:
    results = asyncio.run(_send(cluster.router_url, [_body(p, stream=bool(i % 2)) for i, p in
                                                      enumerate(_prompts(48))]))
    assert all(r.ok and len(r.token_ids) == MAX_TOKENS for r in results), [r.error for r in results]
    for instance in cluster.instances.values():
        assert instance.url is not None
        deadline = time.monotonic() + 20
        while _metric(instance.url, "kvwire_kv_blocks_in_use") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(instance.url, "kvwire_kv_blocks_in_use") == 0, instance.name
