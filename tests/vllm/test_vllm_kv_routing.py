"""KV-aware routing over vLLM's own KV events (decision 100): P and D publish them
(``--kv-events-config``), the plugin forwards them re-hashed as kvwire hashes, the router indexes them.

After a request through the router, ``/instances`` shows the blocks vLLM cached on P and on D; the
same prompt again goes, by ``kv_aware`` (the router's default), to the D that holds it, which
prefills only the few tokens past its cached blocks (P skipped), with output equal to plain vLLM. A
text prompt checks that the router tokenizes like vLLM (the plugin announces the model's tokenizer
directory).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import LOCAL_COMPUTE, Cluster, complete, metric_total, wait_until

BLOCK = 128  # vLLM's block size on CPU
TEXT = " ".join(["the quick brown fox jumps over the lazy dog and the kv cache"] * 24)  # > 2 blocks


@pytest.fixture(scope="module")
def kv_router(cluster: Cluster) -> Iterator[Cluster]:
    cluster.start_router("push", policy=None)  # the default (kv_aware); a fresh router: an empty index
    yield cluster
    cluster.start_router("push")


def kv_cache(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """``/instances``' KV view per instance id: cached_blocks (the router's index), hit_rate."""
    return {inst["id"]: inst.get("kv_cache") or {} for inst in cluster.instances()}


def cached_blocks(cluster: Cluster) -> dict[str, int]:
    return {name: int(kv.get("cached_blocks") or 0) for name, kv in kv_cache(cluster).items()}


def skipped(cluster: Cluster) -> float:
    return metric_total(cluster.router_port, "kvwire_router_skipped_prefills_total", {})


def d_computed(cluster: Cluster) -> float:
    return metric_total(cluster.d_port, "vllm:prompt_tokens_by_source_total", LOCAL_COMPUTE)


def answer(out: dict[str, object]) -> tuple[object, object]:
    choice = out["choices"][0]  # type: ignore[index]
    return choice.get("token_ids"), choice["text"]


def test_repeat_prompt_goes_to_the_vllm_instance_holding_it(kv_router: Cluster) -> None:
    c = kv_router
    ref_url, url = f"http://127.0.0.1:{c.ref_port}", c.router_url()
    rng = random.Random(20)
    prompt = [rng.randrange(3, 512) for _ in range(3 * BLOCK + 5)]  # a prompt neither P nor D saw
    expected = answer(complete(ref_url, prompt))

    assert answer(complete(url, prompt)) == expected  # cold: through P, KV pushed to D
    # P cached the prompt's 3 full blocks, D the same 3 (prompt + 12 new tokens < 4 blocks)
    wait_until(lambda: cached_blocks(c) == {"vllm-p": 3, "vllm-d": 3}, 30, [c.procs["router"]],
               "vLLM's KV events in the router's index")

    skipped_before, computed_before = skipped(c), d_computed(c)
    assert answer(complete(url, prompt)) == expected
    assert skipped(c) - skipped_before == 1  # D held all but 5 tokens: P skipped
    deadline = time.monotonic() + 30  # vLLM updates its counters every few seconds
    while d_computed(c) - computed_before < 5 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert d_computed(c) - computed_before == 5  # D computed only the tokens past its cached blocks
    d_hit_rate = kv_cache(c)["vllm-d"].get("hit_rate")
    assert d_hit_rate is not None and d_hit_rate > 0.4  # 384 of 389 tokens on the second request


def test_text_prompt_is_tokenized_like_vllm(kv_router: Cluster) -> None:
    c = kv_router
    ref_url, url = f"http://127.0.0.1:{c.ref_port}", c.router_url()
    ref = complete(ref_url, TEXT)
    n = int(ref["usage"]["prompt_tokens"])
    assert n > 2 * BLOCK
    blocks_before = cached_blocks(c)["vllm-d"]
    assert answer(complete(url, TEXT)) == answer(ref)
    held = (n + 12 - 1) // BLOCK  # full blocks of prompt + answer (the last token has no KV yet)
    wait_until(lambda: cached_blocks(c)["vllm-d"] == blocks_before + held, 30, [c.procs["router"]],
               "D's blocks of the text prompt in the index")
    skipped_before = skipped(c)
    assert answer(complete(url, TEXT)) == answer(ref)
    assert skipped(c) - skipped_before == 1  # the router's token ids hashed to D's blocks
