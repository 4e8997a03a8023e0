"""The SSE stream from the router to the client: prepared once, metered (TTFT/ITL) as it is written.

Every write has a deadline (``client_write_timeout_s``): a client that stops reading is cut off
(:class:`kvwire.http.front_door.ClientWriter`), the request's outcome becomes ``client_timeout`` and the
write raises a ``ConnectionResetError`` that unwinds the relay like a disconnect (upstream calls closed).
Non-streaming answers get the same deadline through :mod:`kvwire.router.client_body`.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from kvwire.http.front_door import ClientWriter
from kvwire.router.metrics import RouterMetrics, SSETokenMeter
from kvwire.router.request import ClientRequest, Outcome
from kvwire.router.selection import Plan
from kvwire.router.stream_ledger import StreamLedger


class ClientStream:
    """Wraps a ``web.StreamResponse``; :meth:`write` times each event that carries generated text."""

    def __init__(
        self, request: web.Request, creq: ClientRequest, metrics: RouterMetrics, mode: Plan,
        *, write_timeout_s: float, status: int = 200, content_type: str = "text/event-stream",
    ) -> None:
        self._creq = creq
        # Label children resolved once: write() runs per token event.
        self._ttft = metrics.ttft.labels(mode=mode.value)
        self._itl = metrics.itl.labels(mode=mode.value)
        self.response = web.StreamResponse(
            status=status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        self._writer = ClientWriter(request, write_timeout_s, f"router request to {creq.path}",
                                    on_timeout=self._timed_out)
        self._meter = SSETokenMeter()
        self._last: float | None = None

    def _timed_out(self) -> None:
        self._creq.outcome = Outcome.CLIENT_TIMEOUT

    async def open(self) -> ClientStream:
        await self._writer.open(self.response)
        return self

    @property
    def ledger(self) -> StreamLedger | None:
        return self._creq.ledger

    async def write(self, chunk: bytes) -> None:
        """Write upstream bytes (through the request's ledger, when it has one)."""
        if self._creq.ledger is not None:
            chunk = self._creq.ledger.filter(chunk)
        if not chunk:
            return
        await self._writer.write(chunk)
        n = self._meter.feed(chunk)
        if not n:
            return
        now = time.perf_counter()
        if self._last is None:
            self._ttft.observe(now - self._creq.t0)
        else:
            self._itl.observe(now - self._last)
        for _ in range(n - 1):
            self._itl.observe(0.0)
        self._last = now

    async def write_direct(self, data: bytes) -> None:
        """Write router-made bytes (no ledger, no metering)."""
        await self._writer.write(data)

    async def error_event(self, message: str, status: int) -> None:
        """Report a failure in-band (the status line is gone already), OpenAI style."""
        if self._creq.outcome is not Outcome.CLIENT_TIMEOUT:
            self._creq.outcome = Outcome.UPSTREAM_ERROR
        event = {"error": {"message": message, "type": "upstream_error", "code": status}}
        await self._writer.write(b"data: " + msgspec.json.encode(event) + b"\n\n")

    async def close(self) -> web.StreamResponse:
        await self._writer.write_eof()
        return self.response
