"""A small blocking SSE client for fault tests: POST, then read events as they arrive."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit


class SSEResult:
    """Everything one streamed request produced."""

    def __init__(self) -> None:
        self.status = 0
        self.events: list[Any] = []  # decoded JSON events, "[DONE]" for the end marker
        self.error: str | None = None  # transport failure (the stream broke at the client)
        self.elapsed_s = 0.0

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def errors(self) -> list[Any]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, dict) for c in e.get("choices") or []
                for t in c.get("token_ids") or []]

    def text(self) -> str:
        parts = []
        for e in self.events:
            for c in (e.get("choices") or []) if isinstance(e, dict) else []:
                delta = c.get("delta")
                parts.append((delta or {}).get("content") or "" if delta is not None else c.get("text") or "")
        return "".join(parts)

    def ids(self) -> set[str]:
        return {e["id"] for e in self.events if isinstance(e, dict) and "id" in e}


def stream(url: str, path: str, body: dict[str, Any], *, timeout_s: float = 60.0,
           on_event: Callable[[Any], None] | None = None) -> SSEResult:
    """POST ``body`` (stream=true) and read the SSE answer; ``on_event`` sees each event as it comes."""
    parts = urlsplit(url)
    result = SSEResult()
    start = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        result.status = resp.status
        if resp.status != 200:
            result.events.append(json.loads(resp.read() or b"{}"))
            return result
        buf = b""
        while chunk := resp.read1(65536):
            buf += chunk
            while (end := buf.find(b"\n\n")) >= 0:
                block, buf = buf[:end], buf[end + 2:]
                if not block.startswith(b"data: "):
                    continue
                payload = block[6:].strip()
                event = "[DONE]" if payload == b"[DONE]" else json.loads(payload)
                result.events.append(event)
                if on_event is not None:
                    on_event(event)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        result.error = repr(exc)
    finally:
        conn.close()
        result.elapsed_s = time.monotonic() - start
    return result
