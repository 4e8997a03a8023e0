"""The client's request as the router sees it: validated once, never re-parsed per upstream
(:class:`ClientRequest`, :func:`parse_client_request`), how it ended (:class:`Outcome`), and, for a
stream that may migrate, the ledger of what the client has been sent (:class:`StreamLedger`,
attached by :func:`attach_ledger`). No I/O.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvwire.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvwire.router.relay import ClientStream

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


# --- the ledger of a streamed answer -----------------------------------------------------------------
# The ledger of a streamed answer: what one streaming client has been sent, in token ids.
#
# The router asks instances for token ids (``return_token_ids``: every content event carries the
# ``token_ids`` it adds, the first event the ``prompt_token_ids`` and, from kvwire instances, the
# resolved ``kvwire_max_tokens``). A :class:`StreamLedger` reads every event relayed to the client,
# remembers those ids and strips them again unless the client asked for them itself. When the
# upstream stream breaks (connection lost, an error event, an end without ``[DONE]``) the dispatcher
# (:mod:`kvwire.router.dispatcher`) sends :meth:`StreamLedger.continuation` — a ``/v1/completions``
# request whose prompt is the prompt's ids plus every token already streamed, with the remaining
# budget — through the usual P/D or colocated path, and the ledger rewrites that continuation's
# events into the client's stream: same id, creation time, model and object type (chat deltas for a
# chat request), no second role event, usage counting the whole answer. Greedy output is thus
# identical, token for token, to an uninterrupted run. See docs/decisions/052.

DONE = b"data: [DONE]\n\n"
# Fields of the client's request that shape sampling and are meaningful for /v1/completions.
_CARRIED = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens", "logit_bias",
    "user",
)
_COMPLETIONS = "/v1/completions"


def _event_end(buf: bytes) -> int:
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buf.find(sep)) >= 0]
    return min(ends, default=-1)


def _empty(choice: dict[str, Any], text: str, ids: Any) -> bool:
    """A content event that says nothing to the client: no text, no ids, no end, no role."""
    delta = choice.get("delta")
    role = isinstance(delta, dict) and delta.get("role") is not None
    return not text and not ids and choice.get("finish_reason") is None and not role \
        and choice.get("logprobs") is None
def token_ids(value: object) -> list[int] | None:
    """``value`` as token ids when it is a list of non-negative ints (an instance's ``token_ids`` or
    ``prompt_token_ids``), else None: the router treats malformed ids as absent, never trusts them."""
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        return None
    return value


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


class StreamLedger:
    """What one streaming client has been sent, and the rewriting of continuation events.

    Contract: :meth:`filter` receives upstream SSE bytes in order and returns the bytes for the
    client. Upstream error events and anything after them are withheld (the dispatcher decides:
    migrate, or report the error). :attr:`interrupted` tells whether the current upstream stream
    ended without completing the answer.
    """

    def __init__(self, creq: ClientRequest, chat: bool) -> None:
        self._creq = creq
        self.chat = chat
        self._client_ids = creq.body.get("return_token_ids") is True
        opts = creq.body.get("stream_options")
        self._client_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        self._buf = b""
        self.base: dict[str, Any] | None = None  # id / object / created / model of the first event
        self.prompt_ids: list[int] | None = None
        self.max_tokens: int | None = None  # the answer's whole budget, when an instance said it
        self.token_ids: list[int] = []  # generated tokens the client has been sent
        self.ids_complete = True  # every content event carried its token ids
        self.finished = False  # an event with a finish_reason went out
        self.done = False  # [DONE] went out
        self.error: str | None = None  # the current upstream sent an error event
        self.migrations = 0
        self._continuing = False

    @classmethod
    def for_request(cls, creq: ClientRequest) -> StreamLedger | None:
        """A ledger for a migratable streaming request (one choice), else None."""
        n = creq.body.get("n")
        if not creq.stream or (n is not None and n != 1) or creq.body.get("best_of") not in (None, 1):
            return None
        return cls(creq, creq.path.endswith("/chat/completions"))

    # --- the relayed bytes ----------------------------------------------------------------------

    def filter(self, chunk: bytes) -> bytes:
        self._buf += chunk
        out: list[bytes] = []
        while (end := _event_end(self._buf)) >= 0:
            event, self._buf = self._buf[:end], self._buf[end:]
            if self.error is None:
                out.append(self._event(event))
        return b"".join(out)

    @property
    def interrupted(self) -> bool:
        return not self.done

    def _event(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data:"):
            return event  # comments, keep-alives
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return event
        try:
            data = msgspec.json.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return event
        if not isinstance(data, dict):
            return event
        if "error" in data:
            err = data.get("error")
            self.error = str(err.get("message") if isinstance(err, dict) else err)
            return b""
        return self._data_event(data, event)

    def _data_event(self, data: dict[str, Any], event: bytes) -> bytes:
        """Record the event; return it unchanged (byte for byte) unless a field had to go."""
        changed = "kvwire_max_tokens" in data or ("prompt_token_ids" in data and not self._client_ids)
        prompt = data.pop("prompt_token_ids", None)
        budget = data.pop("kvwire_max_tokens", None)
        if not self._continuing:
            if self.prompt_ids is None:
                self.prompt_ids = token_ids(prompt)
            if isinstance(budget, int) and self.max_tokens is None:
                self.max_tokens = budget
            if self.base is None:
                self.base = {k: data.get(k) for k in ("id", "object", "created", "model")}
        if self._client_ids and isinstance(prompt, list):
            data["prompt_token_ids"] = prompt
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices:
            return self._usage_event(data, event, changed)
        choice = choices[0]
        if not isinstance(choice, dict):
            return event
        ids = choice.pop("token_ids", None)
        text = self._text(choice)
        valid_ids = token_ids(ids)
        if valid_ids is not None:
            self.token_ids.extend(valid_ids)
        elif text:
            self.ids_complete = False
        if self._client_ids and isinstance(ids, list):
            choice["token_ids"] = ids
        else:
            changed = changed or ids is not None
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self._continuing:
            return self._rewrite(choice, text, bool(ids))
        if changed and _empty(choice, text, ids):
            return b""  # it carried only what the router reads (e.g. D's budget after P's first token)
        return _sse(data) if changed else event

    def _text(self, choice: dict[str, Any]) -> str:
        delta = choice.get("delta")
        value = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        return value if isinstance(value, str) else ""

    def _rewrite(self, choice: dict[str, Any], text: str, has_ids: bool) -> bytes:
        """A continuation (text completion) event in the client's format (an event that only
        carries token ids, e.g. half a UTF-8 character, is kept: like the instance's own stream)."""
        assert self.base is not None
        reason = choice.get("finish_reason")
        if not text and reason is None and not has_ids:
            return b""
        new: dict[str, Any] = {"index": 0, "logprobs": choice.get("logprobs"), "finish_reason": reason}
        if self.chat:
            new["delta"] = {"content": text} if text or reason is None else {}
        else:
            new["text"] = text
        if "token_ids" in choice:
            new["token_ids"] = choice["token_ids"]
        return _sse(dict(self.base, choices=[new]))

    def _usage_event(self, data: dict[str, Any], event: bytes, changed: bool) -> bytes:
        usage = data.get("usage")
        if not self._continuing:
            if isinstance(usage, dict) and not self._client_usage:
                return b""
            return _sse(data) if changed else event
        if not self._client_usage or not isinstance(usage, dict):
            return b""
        return _sse(dict(self.base or {}, choices=[], usage=self._whole_usage()))

    def _whole_usage(self) -> dict[str, int]:
        prompt = len(self.prompt_ids or ())
        done = len(self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    # --- migration ------------------------------------------------------------------------------

    def can_continue(self) -> bool:
        return self.prompt_ids is not None and self.ids_complete and self.base is not None

    def remaining(self) -> int | None:
        budget = self.max_tokens if self.max_tokens is not None else self._client_budget()
        return None if budget is None else budget - len(self.token_ids)

    def _client_budget(self) -> int | None:
        for key in ("max_completion_tokens", "max_tokens"):
            value = self._creq.body.get(key)
            if isinstance(value, int):
                return value
        return 16 if not self.chat else None  # OpenAI's completions default

    def tail(self) -> bytes:
        """What the client still needs when the answer is complete but its stream end was lost."""
        usage = b""
        if self._client_usage:
            usage = _sse(dict(self.base or {}, choices=[], usage=self._whole_usage()))
        self.done = True
        return usage + DONE

    def continuation(self) -> ClientRequest:
        """The request that continues the answer on another instance; switches :meth:`filter` to
        rewriting. Call only when :meth:`can_continue` and the answer is unfinished."""
        assert self.prompt_ids is not None
        body: dict[str, Any] = {k: self._creq.body[k] for k in _CARRIED if k in self._creq.body}
        body.update(
            prompt=self.prompt_ids + self.token_ids, stream=True, return_token_ids=True,
            stream_options={"include_usage": True}, kvwire_prior_output_tokens=len(self.token_ids),
        )
        remaining = self.remaining()
        if remaining is not None:
            body["max_tokens"] = remaining
        min_tokens = self._creq.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > len(self.token_ids):
            body["min_tokens"] = min_tokens - len(self.token_ids)
        self.migrations += 1
        self._continuing = True
        self.error = None
        self._buf = b""
        raw = msgspec.json.encode(body)
        return ClientRequest(path=_COMPLETIONS, raw=raw, body=body, headers=dict(self._creq.headers),
                             t0=self._creq.t0)


def attach_ledger(creq: ClientRequest, max_migrations: int) -> StreamLedger | None:
    """The ledger of ``creq``'s stream when it may migrate (else None); instances are then asked
    for the token ids the ledger needs (``return_token_ids``)."""
    if max_migrations == 0:
        return None
    ledger = StreamLedger.for_request(creq)
    if ledger is not None:
        creq.ledger = ledger
        creq.body["return_token_ids"] = True  # instances tell the ledger the token ids
        creq.raw = msgspec.json.encode(creq.body)
    return ledger
