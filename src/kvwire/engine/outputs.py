"""What the engine hands back: one RequestOutput per request per step, and engine statistics."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RequestOutput:
    """A request's progress after a step. ``token_ids``/``text`` cover all output so far;
    ``new_token_ids``/``new_text`` only what this step added (for streaming)."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # from the connector's request_finished
    num_cached_tokens: int = 0  # prompt tokens not computed here (prefix cache or remote KV)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    kv_blocks_in_use: int
    kv_blocks_total: int
    num_preemptions: int  # requests preempted (their KV recomputed later) since start
    num_kv_load_failures: int  # remote KV loads that failed since start
    num_kv_load_recomputes: int  # of those, requests recomputed locally
    num_delayed_free_requests: int  # finished requests whose blocks wait for a send to complete
    num_prefix_cache_hit_tokens: int
    num_prompt_tokens: int  # prompt tokens computed since start
    num_generation_tokens: int  # tokens sampled since start
    num_steps: int
