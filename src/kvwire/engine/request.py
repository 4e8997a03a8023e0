"""A request inside the engine: its tokens, its KV blocks, its state."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from kvwire.engine.sampling_params import SamplingParams
from kvwire.engine.tokenizer import IncrementalDetokenizer
from kvwire.protocol.kv_params import KVParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; not yet (or no longer, after preemption) holding KV blocks
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated; a connector is loading them
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Satisfies ``kvwire.connector.base.ConnectorRequest`` (plus ``output_token_ids`` and
    ``num_computed_tokens``, which connectors may read, as in vLLM)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        kv_transfer_params: KVParams | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: Sequence[int] = tuple(prompt_token_ids)
        self.params = params
        self.kv_transfer_params = kv_transfer_params
        self.generator = generator  # per-request seed; None = the engine's generator
        self.detokenizer = detokenizer
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(prompt_token_ids)  # prompt + output, kept in step by append_token
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache hashes of full blocks (memo, see BlockManager)
        self.num_computed_tokens = 0  # tokens of all_token_ids whose KV is in block_ids
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache or a remote instance
        self.asked_connector = False  # the connector is asked until the request gets its blocks, then never
        self.num_external_tokens = 0  # tokens a connector loads asynchronously (WAITING_FOR_REMOTE_KV)
        self.error: str | None = None
        self.stop_text_len: int | None = None  # output text cut here by a stop string

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens (do not modify; use append_token)."""
        return self._all_token_ids

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._all_token_ids.append(token)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
