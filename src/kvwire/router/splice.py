"""Streaming P's first token at once (push mode, the default): the client stream's first event comes
from P's ``max_tokens=1`` answer, and the same token is then removed from the start of D's stream.

Pure byte/JSON logic, no I/O. Only D's first events are rewritten; once P's token has been matched,
the rest of D's stream passes through byte for byte. P and D answer under one id (the router gives
both the same ``request_id``), so the client sees one stream.

Matching is exact when the answers carry token ids (``return_token_ids``, which the router asks for
on every migratable stream): D's leading ids must be P's, and its leading text P's text. When D
differs (it recomputed, or sampled another token), :attr:`FirstTokenSplicer.diverged` is set and
:meth:`FirstTokenSplicer.filter` withholds D's stream from that event on: the router then continues
the answer from P's token elsewhere (a migration, decision 052), so that the client never sees a
duplicate or a missing token. Without ids (text only) a mismatch stops splicing and D's events pass
unchanged (logged). See docs/decisions/041 and 121.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

log = logging.getLogger(__name__)
# Fields of D's first event that the early events already carried, or that the router's ledger reads.
_PROMPT_IDS = "prompt_token_ids"
_BUDGET = "kvwire_max_tokens"


def _first_choice(answer: dict[str, Any]) -> dict[str, Any] | None:
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return choices[0]


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    return None


class FirstTokenSplicer:
    """Contract: :meth:`early_events` once, then D's bytes in order through :meth:`filter`, then
    :meth:`flush`. Event-loop thread, one per request."""

    def __init__(
        self, text: str, chat: bool, base: dict[str, Any], token_ids: list[int] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.text = text  # P's first token, as text
        self.token_ids = token_ids  # P's first token's id(s), when P returned them
        self._prompt_ids = prompt_ids
        self._chat = chat
        self._base = base  # id / object / created / model for the synthesized events
        self._matched = 0  # characters of ``text`` found at the start of D's stream so far
        self._ids_matched = 0
        self._done = False
        self.diverged = False  # D's stream does not continue P's token (ids known): withheld
        self._buf = b""

    @classmethod
    def from_prefill(cls, answer_bytes: bytes, chat: bool) -> FirstTokenSplicer | None:
        """A splicer for P's non-streaming answer, or None when it has no single non-empty text."""
        try:
            answer = msgspec.json.decode(answer_bytes)
        except (msgspec.DecodeError, RecursionError):
            return None
        if not isinstance(answer, dict) or (choice := _first_choice(answer)) is None:
            return None
        message = choice.get("message")
        text = (message.get("content") if isinstance(message, dict) else None) if chat else choice.get("text")
        if not isinstance(text, str) or not text:
            return None
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": answer.get("id", "cmpl-kvwire"), "object": obj, "created": answer.get("created", 0),
                "model": answer.get("model", "")}
        ids = _int_list(choice.get("token_ids"))
        prompt_ids = _int_list(answer.get(_PROMPT_IDS)) or _int_list(choice.get(_PROMPT_IDS))  # kvwire, vLLM
        return cls(text, chat, base, ids or None, prompt_ids)

    def early_events(self) -> bytes:
        """The SSE bytes to send the client now (chat: role chunk, then the token)."""
        token: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        if self._chat:
            token["delta"] = {"content": self.text}
        else:
            token["text"] = self.text
        if self.token_ids is not None:
            token["token_ids"] = self.token_ids
        first = dict(self._base)
        if self._prompt_ids is not None:
            first[_PROMPT_IDS] = self._prompt_ids
        if not self._chat:
            return _sse(dict(first, choices=[token]))
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        return _sse(dict(first, choices=[role])) + _sse(dict(self._base, choices=[token]))

    def filter(self, chunk: bytes) -> bytes:
        """D's bytes with P's token removed from the start (events may be split across chunks)."""
        if self._done:
            return b"" if self.diverged else chunk
        self._buf += chunk
        out: list[bytes] = []
        while not self._done:
            end = _event_end(self._buf)
            if end < 0:
                break
            event, self._buf = self._buf[:end], self._buf[end:]
            out.append(self._event(event))
        if self._done:
            if not self.diverged:
                out.append(self._buf)
            self._buf = b""
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return b"" if self.diverged else rest

    def _event(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            return event
        try:
            data = msgspec.json.decode(line[5:].strip())
            choice = data["choices"][0]
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, RecursionError):
            return event  # usage-only or foreign events pass unchanged
        if not isinstance(choice, dict):
            return event
        delta = choice.get("delta") if self._chat else None
        if self._chat:
            if not isinstance(delta, dict):
                return event  # a chat event without a delta object: not one to trim
            text = delta.get("content")
        else:
            text = choice.get("text")
        text = text if isinstance(text, str) else ""
        if self._chat and isinstance(delta, dict) and delta.pop("role", None) is not None and not text:
            return self._emit(data, choice, "")  # the role chunk went out with the early events
        return self._trim(data, choice, text, event)

    def _trim(self, data: dict[str, Any], choice: dict[str, Any], text: str, event: bytes) -> bytes:
        ids = _int_list(choice.get("token_ids"))
        keep_ids = self._match_ids(ids) if self.token_ids is not None and ids is not None else ids
        keep = self._match_text(text) if not self.diverged else None
        if keep is None:
            if self.token_ids is None:  # text only: cannot tell; pass D's stream on (decision 041)
                log.warning("decode output does not start with the prefill token %r; splicing stopped",
                            self.text)
                self._done = True
                return event
            self.diverged = self._done = True
            return b""
        if self._matched == len(self.text) and (self.token_ids is None or
                                                 self._ids_matched == len(self.token_ids)):
            self._done = True
        if keep_ids is not None:
            choice["token_ids"] = keep_ids
        return self._emit(data, choice, keep)

    def _match_ids(self, ids: list[int]) -> list[int] | None:
        assert self.token_ids is not None
        need = self.token_ids[self._ids_matched:]
        n = min(len(need), len(ids))
        if ids[:n] != need[:n]:
            self.diverged = True
            return None
        self._ids_matched += n
        return ids[n:]

    def _match_text(self, text: str) -> str | None:
        """What is left of ``text`` after P's text; None when it does not continue P's."""
        remaining = self.text[self._matched:]
        if remaining.startswith(text):
            self._matched += len(text)
            return ""
        if text.startswith(remaining):
            self._matched = len(self.text)
            return text[len(remaining):]
        return None

    def _emit(self, data: dict[str, Any], choice: dict[str, Any], keep: str) -> bytes:
        data.pop(_PROMPT_IDS, None)  # sent with the early events
        if not keep and not choice.get("token_ids") and choice.get("finish_reason") is None \
                and not data.get("usage") and _BUDGET not in data:
            return b""  # nothing left to say in this event
        if self._chat:
            choice["delta"] = {"content": keep} if keep or choice.get("finish_reason") is None else {}
        else:
            choice["text"] = keep
        return _sse(data)


def _event_end(buf: bytes) -> int:
    """Index just past the first complete SSE event in ``buf`` (LF or CRLF line ends), or -1.

    An event is relayed as soon as its blank line arrives: looking for LF-only separators would hold a
    CRLF stream back until its end.
    """
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buf.find(sep)) >= 0]
    return min(ends, default=-1)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"
