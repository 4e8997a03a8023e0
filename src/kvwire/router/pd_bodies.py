"""What P and D are sent in push and pull mode: P's one-token copy of the request, D's copy, and
the fields both get when P's first token opens the client's stream (decision 121). Pure functions of
the client's request; no I/O."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from kvwire.protocol.kv_params import KVTransferParams
from kvwire.router.request import ClientRequest


def prefill_body(creq: ClientRequest, params: KVTransferParams, **shared: Any) -> bytes:
    """P's copy of the request: one token, non-streaming, with its kv_transfer_params."""
    return creq.derived_body(
        max_tokens=1, max_completion_tokens=1, stream=False, stream_options=None, min_tokens=None,
        kv_transfer_params=params.to_dict(), **shared,
    )


def decode_body(creq: ClientRequest, params: KVTransferParams, **shared: Any) -> bytes:
    return creq.derived_body(kv_transfer_params=params.to_dict(), **shared)


# Request fields that make P's one-token answer something other than a stream's first event.
_NOT_SPLICEABLE = ("logprobs", "top_logprobs", "echo", "prompt_logprobs")


def spliceable(creq: ClientRequest) -> bool:
    """Whether P's first token can open the client's stream: a new request (not a continuation),
    one choice, no log-probabilities or echo (P's answer would carry them differently)."""
    body = creq.body
    if creq.resume_stream is not None or body.get("n") not in (None, 1):
        return False
    if body.get("best_of") not in (None, 1):
        return False
    return not any(body.get(key) not in (None, False, 0) for key in _NOT_SPLICEABLE)


def shared_fields(creq: ClientRequest) -> dict[str, Any]:
    """Fields P and D both get when P's first token opens the stream: one ``request_id`` (vLLM's
    field: both answer under the same id) and, for a sampled request without a seed, one random
    ``seed`` (both draw the same first token from the same logits, so D continues P's)."""
    body = creq.body
    rid = body.get("request_id")
    shared: dict[str, Any] = {"request_id": rid if isinstance(rid, str) and rid else uuid.uuid4().hex}
    if body.get("seed") is None and body.get("temperature") not in (0, 0.0):
        shared["seed"] = secrets.randbits(31)
    return shared
