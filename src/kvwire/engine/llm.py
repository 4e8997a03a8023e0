"""``kvwire.LLM``: offline batch generation over one LLMEngine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.model_runner import SamplingParams
from kvwire.engine.outputs import RequestOutput
from kvwire.errors import InvalidRequestError


class LLM:
    """``LLM(model="tiny" | PATH, device="cpu" | "cuda", dtype="auto" | "float32" | ...)``.
    Other EngineConfig fields may be given by name (``block_size=16``, ``num_kv_blocks=...``)."""

    def __init__(
        self, model: str = "tiny", device: str = "cpu", dtype: str = "auto", **config: object
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, **config))  # type: ignore[arg-type]
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (``.token_ids``, ``.text``)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = _params_per_prompt(params, len(prompts))
        ids = []
        for prompt, p in zip(prompts, params_list, strict=True):
            if isinstance(prompt, str):
                token_ids = self.engine.tokenizer.encode(prompt)
            else:
                token_ids = list(cast("Sequence[int]", prompt))
            ids.append(f"llm-{next(self._ids)}")
            self.engine.add_request(ids[-1], token_ids, p)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def close(self) -> None:
        self.engine.close()


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} SamplingParams for {n} prompts")
    return list(params)
