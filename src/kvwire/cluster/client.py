"""A small OpenAI-API client that times requests (TTFT, inter-chunk latencies, end to end).

Used by ``kvwire demo``, ``kvwire bench serve`` and the end-to-end tests. Streaming responses are
read as server-sent events; ``return_token_ids`` (a kvwire/vLLM extension) gives exact token ids.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp


@dataclasses.dataclass
class RequestResult:
    ok: bool
    status: int
    error: str | None = None
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float | None = None  # first chunk carrying output (streaming) / whole answer (not)
    itls_s: list[float] = dataclasses.field(default_factory=list)  # gaps between output chunks
    e2e_s: float = 0.0
    body: dict[str, Any] | None = None  # the final JSON body (non-streaming)


def _choice(payload: dict[str, Any]) -> dict[str, Any]:
    choices = payload.get("choices") or [{}]
    first: dict[str, Any] = choices[0]
    return first


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    return str((choice.get("delta") or {}).get("content") or "")


async def post_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    timeout_s: float = 120.0,
    on_text: Callable[[str], None] | None = None,
) -> RequestResult:
    """POST ``body`` to ``url`` (``/v1/completions`` or ``/v1/chat/completions``) and time it.
    Never raises for HTTP, connection or malformed-JSON errors: they come back as ``ok=False`` with
    the message. ``on_text`` (streaming only) is called with each chunk's text as it arrives."""
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.post(url, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                text = await resp.text()
                return RequestResult(False, resp.status, error=text[:500], e2e_s=time.perf_counter() - start)
            if body.get("stream"):
                return await _read_stream(resp, start, on_text)
            payload = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a body that is not JSON
        error = f"{type(exc).__name__}: {exc}"
        return RequestResult(False, 0, error=error, e2e_s=time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    choice = _choice(payload)
    usage = payload.get("usage") or {}
    text = str(choice.get("text") or (choice.get("message") or {}).get("content") or "")
    token_ids = list(choice.get("token_ids") or [])
    return RequestResult(
        True, 200, text=text, token_ids=token_ids, finish_reason=choice.get("finish_reason"),
        num_prompt_tokens=int(usage.get("prompt_tokens", 0)),
        num_output_tokens=int(usage.get("completion_tokens", len(token_ids))),
        ttft_s=elapsed, e2e_s=elapsed, body=payload,
    )


async def _read_stream(
    resp: aiohttp.ClientResponse, start: float, on_text: Callable[[str], None] | None
) -> RequestResult:
    result = RequestResult(True, 200)
    last: float | None = None
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        payload = json.loads(data)
        if "error" in payload:
            result.ok, result.error = False, str(payload["error"])
            continue
        usage = payload.get("usage")
        if usage:
            result.num_prompt_tokens = int(usage.get("prompt_tokens", 0))
            result.num_output_tokens = int(usage.get("completion_tokens", 0))
        if not payload.get("choices"):
            continue
        choice = _choice(payload)
        new_ids = list(choice.get("token_ids") or [])
        text = _chunk_text(choice)
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        if not new_ids and not text:
            continue  # role / empty chunk: no output yet
        now = time.perf_counter()
        if last is None:
            result.ttft_s = now - start
        else:
            result.itls_s.append(now - last)
        last = now
        result.token_ids += new_ids
        result.text += text
        if on_text is not None and text:
            on_text(text)
    result.e2e_s = time.perf_counter() - start
    if not result.num_output_tokens:
        result.num_output_tokens = len(result.token_ids)
    return result
