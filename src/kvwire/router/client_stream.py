"""The SSE stream from the router to the client: prepared once, metered (TTFT/ITL) as it is written."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from kvwire.router.metrics import RouterMetrics, SSETokenMeter
from kvwire.router.request import ClientRequest


class ClientStream:
    """Wraps a ``web.StreamResponse``; :meth:`write` times each event that carries generated text."""

    def __init__(
        self, request: web.Request, creq: ClientRequest, metrics: RouterMetrics, mode: str,
        *, status: int = 200, content_type: str = "text/event-stream",
    ) -> None:
        self._request = request
        self._creq = creq
        self._metrics = metrics
        self._mode = mode
        self.response = web.StreamResponse(
            status=status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        self._meter = SSETokenMeter()
        self._last: float | None = None

    async def open(self) -> ClientStream:
        await self.response.prepare(self._request)
        return self

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        await self.response.write(chunk)
        n = self._meter.feed(chunk)
        if not n:
            return
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.labels(mode=self._mode).observe(now - self._creq.t0)
        else:
            self._metrics.itl.labels(mode=self._mode).observe(now - self._last)
        for _ in range(n - 1):
            self._metrics.itl.labels(mode=self._mode).observe(0.0)
        self._last = now

    async def error_event(self, message: str, status: int) -> None:
        """Report a failure in-band (the status line is gone already), OpenAI style."""
        self._creq.outcome = "upstream_error"
        event = {"error": {"message": message, "type": "upstream_error", "code": status}}
        await self.response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response
