"""The client's request as the router sees it: validated once, never re-parsed per upstream."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvwire.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvwire.router.client_stream import ClientStream
    from kvwire.router.stream_ledger import StreamLedger

_FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
_DEFAULT_MAX_TOKENS = 16  # what OpenAI /v1/completions assumes when max_tokens is absent
KV_PARAMS_FIELD = "kv_transfer_params"  # the router's to set; a client's is dropped


class Outcome(str, enum.Enum):
    """How a client request ended (the ``outcome`` label of ``kvwire_router_requests``)."""

    OK = "ok"
    ERROR = "error"  # the router failed unexpectedly
    UPSTREAM_ERROR = "upstream_error"  # an instance failed it (status and body passed through)
    CLIENT_TIMEOUT = "client_timeout"  # the client stopped reading (write deadline)
    CLIENT_DISCONNECTED = "client_disconnected"
    TOO_LARGE = "too_large"  # 413
    INVALID = "invalid"  # 400
    MODEL_NOT_FOUND = "model_not_found"  # 404
    NO_INSTANCE = "no_instance"  # 503
    BODY_TIMEOUT = "body_timeout"  # 408: the body did not arrive within --http-body-timeout-s


@dataclass
class ClientRequest:
    path: str  # "/v1/completions" or "/v1/chat/completions"
    raw: bytes  # the body exactly as received (forwarded untouched when no field changes)
    body: dict[str, Any]
    headers: dict[str, str]  # forwarded to instances
    t0: float = field(default_factory=time.perf_counter)  # arrival, perf_counter seconds
    outcome: Outcome = Outcome.OK  # set by whoever decides how the request ended (metrics label)
    prompt_token_ids: list[int] | None = None  # set when the router tokenized the prompt (kv_aware)
    ledger: StreamLedger | None = None  # streaming: what the client was sent (mid-stream migration)
    resume_stream: ClientStream | None = None  # a continuation: the client stream it writes into
    # The client sent kv_transfer_params: removed from ``body`` and ``raw`` (only the router's own,
    # signed when it has a secret, ever reach an instance; decision 124).
    client_kv_params: bool = False

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) and model else None

    @property
    def max_new_tokens(self) -> int:
        for key in ("max_completion_tokens", "max_tokens"):
            value = self.body.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return _DEFAULT_MAX_TOKENS

    @property
    def est_prompt_tokens(self) -> int:
        """The prompt's length in tokens when the router tokenized it (KV-aware routing), else a
        rough estimate (characters / 4 or token ids); for load accounting only."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        prompt = self.body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt) // 4 + 1
        if isinstance(prompt, list):
            return sum(len(p) // 4 + 1 if isinstance(p, str) else 1 for p in prompt)
        messages = self.body.get("messages")
        if isinstance(messages, list):
            return sum(len(str(m.get("content", ""))) // 4 + 4 for m in messages if isinstance(m, dict))
        return 1

    def derived_body(self, **overrides: Any) -> bytes:
        """The body with ``overrides`` applied (a ``None`` value removes the field), as JSON bytes."""
        body = dict(self.body)
        for key, value in overrides.items():
            if value is None:
                body.pop(key, None)
            else:
                body[key] = value
        return msgspec.json.encode(body)


def parse_client_request(path: str, raw: bytes, headers: Mapping[str, str]) -> ClientRequest:
    """Validate the parts the router relies on; the instance validates the rest (its 400 is passed on)."""
    if not raw.strip():
        raise InvalidRequestError("request body is empty; expected a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec's nesting guard (about 1,000 levels of arrays/objects)
        raise InvalidRequestError("request body nests JSON arrays/objects too deeply") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequestError("'stream' must be a boolean")
    if "model" in body and not isinstance(body["model"], (str, type(None))):
        raise InvalidRequestError("'model' must be a string")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise InvalidRequestError(f"'{key}' must be a positive integer")
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            raise InvalidRequestError("'messages' must be a list")
    elif "prompt" not in body:
        raise InvalidRequestError("'prompt' is required")
    forwarded = {"Content-Type": "application/json"}
    for name in _FORWARDED_HEADERS:
        value = headers.get(name)
        if value:
            forwarded[name] = value
    client_kv_params = KV_PARAMS_FIELD in body
    if client_kv_params:  # never forwarded, on any path (P/D, P skipped, D alone, colocated, migration)
        del body[KV_PARAMS_FIELD]
        raw = msgspec.json.encode(body)
    return ClientRequest(path=path, raw=raw, body=body, headers=forwarded, client_kv_params=client_kv_params)
