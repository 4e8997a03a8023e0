"""Helpers of the P/D GPU tests (tests/gpu/test_pd_*.py): prompts of varied lengths, request bodies,
sending a batch, reading a Prometheus metric, and the colocated reference output."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import aiohttp

from kvwire.cluster.client import RequestResult, post_completion

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
