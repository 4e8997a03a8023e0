"""kvwire: disaggregated prefill/decode LLM serving.

Packages: ``transfer`` moves KV bytes between processes; ``connector`` glues an engine to it;
``engine`` is the small built-in paged-KV engine; ``server`` puts one engine behind the OpenAI API;
``router`` is the OpenAI front door with service discovery; ``integrations.vllm`` is the vLLM plugin.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import kvwire` (router, CLI) does not import torch.
    if name == "LLM":
        from kvwire.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvwire.engine.model_runner import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvwire' has no attribute {name!r}")
