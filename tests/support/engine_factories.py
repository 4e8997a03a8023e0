"""Shared helpers for engine tests: small engines on the tiny preset and a run-to-completion loop."""

from __future__ import annotations

import random
from typing import Any

from kvwire.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams


def make_engine(**overrides: Any) -> LLMEngine:
    fields: dict[str, Any] = {"model": "tiny", "device": "cpu", "dtype": "float32", "num_kv_blocks": 256}
    fields.update(overrides)
    scheduler_connector = fields.pop("scheduler_connector", None)
    worker_connector = fields.pop("worker_connector", None)
    return LLMEngine(EngineConfig(**fields), scheduler_connector, worker_connector)


def random_prompts(n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [256] + [rng.randrange(32, 127) for _ in range(rng.randint(min_len, max_len) - 1)] for _ in range(n)
    ]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until nothing is left; returns each request's final output. Checks streaming deltas add
    up to the final token ids."""
    final: dict[str, RequestOutput] = {}
    streamed: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert streamed[out.request_id] == out.token_ids
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
    else:
        raise AssertionError("engine did not finish within max_steps")
    return final


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    final = run_all(engine)
    return [final[f"r{i}"].token_ids for i in range(len(prompts))]
