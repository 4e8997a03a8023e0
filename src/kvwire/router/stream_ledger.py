"""The ledger of a streamed answer: what one streaming client has been sent, in token ids.

The router asks instances for token ids (``return_token_ids``: every content event carries the
``token_ids`` it adds, the first event the ``prompt_token_ids`` and, from kvwire instances, the
resolved ``kvwire_max_tokens``). A :class:`StreamLedger` reads every event relayed to the client,
remembers those ids and strips them again unless the client asked for them itself. When the
upstream stream breaks (connection lost, an error event, an end without ``[DONE]``) the dispatcher
(:mod:`kvwire.router.dispatcher`) sends :meth:`StreamLedger.continuation` — a ``/v1/completions``
request whose prompt is the prompt's ids plus every token already streamed, with the remaining
budget — through the usual P/D or colocated path, and the ledger rewrites that continuation's
events into the client's stream: same id, creation time, model and object type (chat deltas for a
chat request), no second role event, usage counting the whole answer. Greedy output is thus
identical, token for token, to an uninterrupted run. See docs/decisions/052.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvwire.router.request import ClientRequest

log = logging.getLogger(__name__)

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
