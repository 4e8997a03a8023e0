"""Streaming P's first token at once (push mode, opt-in): the client stream's first event comes from
P's ``max_tokens=1`` answer, and the same text is then removed from the start of D's stream.

Pure byte/JSON logic, no I/O. Only the first few of D's events are rewritten; once P's text has been
matched, the rest of D's stream passes through byte for byte. If D's text does not start with P's
(it recomputed and sampled another token), splicing stops and D's events pass unchanged (logged).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

log = logging.getLogger(__name__)


def _first_text(answer: dict[str, Any], chat: bool) -> str | None:
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    message = choice.get("message")
    text = (message.get("content") if isinstance(message, dict) else None) if chat else choice.get("text")
    return text if isinstance(text, str) and text else None


class FirstTokenSplicer:
    def __init__(self, text: str, chat: bool, base: dict[str, Any]) -> None:
        self.text = text  # P's first token, as text
        self._chat = chat
        self._base = base  # id / object / created / model for the synthesized events
        self._matched = 0  # characters of ``text`` found at the start of D's stream so far
        self._done = False
        self._buf = b""

    @classmethod
    def from_prefill(cls, answer_bytes: bytes, chat: bool) -> FirstTokenSplicer | None:
        """A splicer for P's non-streaming answer, or None when it has no single non-empty text."""
        try:
            answer = msgspec.json.decode(answer_bytes)
        except (msgspec.DecodeError, RecursionError):
            return None
        if not isinstance(answer, dict):
            return None
        text = _first_text(answer, chat)
        if text is None:
            return None
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": answer.get("id", "cmpl-kvwire"), "object": obj, "created": answer.get("created", 0),
                "model": answer.get("model", "")}
        return cls(text, chat, base)

    def early_events(self) -> bytes:
        """The SSE bytes to send the client now (chat: role chunk, then the token)."""
        if self._chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            token = {"index": 0, "delta": {"content": self.text}, "finish_reason": None}
            return _sse(dict(self._base, choices=[role])) + _sse(dict(self._base, choices=[token]))
        token = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": None}
        return _sse(dict(self._base, choices=[token]))

    def filter(self, chunk: bytes) -> bytes:
        """D's bytes with P's text removed from the start (events may be split across chunks)."""
        if self._done:
            return chunk
        self._buf += chunk
        out: list[bytes] = []
        while not self._done:
            end = _event_end(self._buf)
            if end < 0:
                break
            event, self._buf = self._buf[:end], self._buf[end:]
            out.append(self._event(event))
        if self._done:
            out.append(self._buf)
            self._buf = b""
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

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
            if delta.get("role") and not delta.get("content"):
                return b""  # the role chunk was already sent with the early events
            text = delta.get("content")
        else:
            text = choice.get("text")
        text = text if isinstance(text, str) else ""
        return self._trim(data, choice, delta, text, event)

    def _trim(
        self, data: dict[str, Any], choice: dict[str, Any], delta: Any, text: str, event: bytes
    ) -> bytes:
        remaining = self.text[self._matched :]
        if remaining.startswith(text):
            self._matched += len(text)
            keep = ""
        elif text.startswith(remaining):
            self._matched = len(self.text)
            keep = text[len(remaining) :]
        else:
            log.warning("decode output does not start with the prefill token %r; splicing stopped", self.text)
            self._done = True
            return event
        if self._matched == len(self.text):
            self._done = True
        if not keep and choice.get("finish_reason") is None and not data.get("usage"):
            return b""  # nothing left to say in this event
        if self._chat:
            delta["content"] = keep
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
