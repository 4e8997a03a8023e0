"""The built-in engine: a small paged-KV Llama/Qwen engine, CPU and CUDA, with KV-connector hooks.

Read in order: llm_engine.py (the request, step, stop checks) -> scheduler.py (schedule, KV blocks)
-> model_runner.py (run, sampling) -> attention.py / models/llama.py (forward).
"""

from __future__ import annotations

from kvwire.engine.config import AttentionBackend, EngineConfig, KVLoadFailurePolicy
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.model_runner import SamplingParams
from kvwire.engine.outputs import EngineStats, RequestOutput

__all__ = [
    "AttentionBackend",
    "EngineConfig",
    "EngineStats",
    "KVLoadFailurePolicy",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
