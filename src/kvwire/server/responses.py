"""OpenAI response bodies and SSE chunks for ``/v1/completions`` and ``/v1/chat/completions``.

Pure functions of their inputs (no engine, no HTTP), so the wire format is tested on its own.
Streaming follows OpenAI: ``data: {json}\\n\\n`` events, the last content chunk carries
``finish_reason``, an optional usage chunk with empty ``choices`` follows, then ``data: [DONE]``.
kvwire extensions: top-level ``kv_transfer_params`` (non-streaming body and the final streaming
chunk), and ``token_ids`` / ``prompt_token_ids`` when the request asked ``return_token_ids``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from kvwire.server.openai_protocol import RequestKind

SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def json_bytes(payload: dict[str, Any]) -> bytes:
    return _encoder.encode(payload)


def error_body(
    status: int, message: str, err_type: str = "invalid_request_error", param: str | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """vLLM's error body (``ErrorResponse``: ``code`` is the HTTP status, an int); ``reason``, when
    given, is kvwire's machine-readable cause (``queue_full``, ``instance_lost``, ...: what a router or
    script branches on), an extra field that vLLM's and OpenAI's clients ignore."""
    error: dict[str, Any] = {"message": message, "type": err_type, "param": param, "code": status}
    if reason is not None:
        error["reason"] = reason
    return {"error": error}


def usage_body(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


@dataclasses.dataclass(frozen=True)
class ResponseBuilder:
    """Builds every body of one request (same id, model and creation time throughout)."""

    kind: RequestKind
    response_id: str
    model: str
    created: int
    return_token_ids: bool = False

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        usage: dict[str, int],
        kv_transfer_params: dict[str, Any] | None,
        prompt_token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming body."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.kind is RequestKind.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
            body = self._envelope("chat.completion", [choice])
        else:
            choice["text"] = text
            body = self._envelope("text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            body["prompt_token_ids"] = prompt_token_ids
        body["usage"] = usage
        body["kv_transfer_params"] = kv_transfer_params
        return body

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role; completions have no opening chunk."""
        if self.kind is not RequestKind.CHAT:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streaming content chunk; the final one has ``finish_reason`` and ``kv_transfer_params``."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.kind is RequestKind.CHAT:
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice["text"] = text
            body = self._envelope("text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        if finish_reason is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind is RequestKind.CHAT else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage
        return body
