"""Helpers of the P/D GPU tests (tests/gpu/test_pd_*.py): prompts of varied lengths, request bodies,
sending a batch, reading a Prometheus metric, and the colocated reference output."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.protocol.kv_params import TransferMode

LENGTHS = (1, 15, 16, 17, 53, 1015)
MAX_TOKENS = 8


def prompts_of(n: int) -> list[list[int]]:
    return [[(7 * j + 13 * i) % 250 + 1 for j in range(LENGTHS[i % len(LENGTHS)])] for i in range(n)]


def body(prompt: list[int], stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }


async def send(url: str, bodies: list[dict]) -> list[RequestResult]:
    async with aiohttp.ClientSession() as session:
        calls = [post_completion(session, f"{url}/v1/completions", b, timeout_s=120) for b in bodies]
        return list(await asyncio.gather(*calls))


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def reference(prompts: list[list[int]]) -> list[list[int]]:
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


def pd_cluster(
    mode: TransferMode, tmp: pytest.TempPathFactory, name: str, **spec: Any
) -> Iterator[LocalCluster]:
    """A 1P1D cluster of the tiny model in fp32 on CUDA (``spec`` adds ClusterSpec fields); its log is
    printed when it stops."""
    cluster_spec = ClusterSpec(
        num_prefill=1,
        num_decode=1,
        device="cuda",
        mode=mode,
        serve_args=("--dtype", "float32", "--num-kv-blocks", "4096"),
        start_timeout_s=300,
        **spec,
    )
    log = tmp.mktemp(name) / f"cluster-{mode.value}.log"
    with open(log, "w") as sink, LocalCluster(cluster_spec, sink=sink) as pd:
        yield pd
    print(Path(log).read_text()[-3000:])
