"""The built-in engine: a small paged-KV Llama/Qwen engine, CPU and CUDA, with KV-connector hooks.

Read in order: llm_engine.py (step) -> scheduler.py (schedule) -> model_runner.py (run) ->
attention.py / models/llama.py (forward) -> sampler.py, stop.py (postprocess).
"""

from __future__ import annotations

from kvwire.engine.config import AttentionBackend, EngineConfig, KVLoadFailurePolicy
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.outputs import EngineStats, RequestOutput
from kvwire.engine.sampling_params import SamplingParams

__all__ = [
    "AttentionBackend",
    "EngineConfig",
    "EngineStats",
    "KVLoadFailurePolicy",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
