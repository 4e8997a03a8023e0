"""Writes to an HTTP client under a deadline (server and router: SSE streams and whole bodies).

A client that stops reading but keeps its connection open fills the socket buffers; aiohttp's
``write`` then waits in ``drain`` for ever. :class:`ClientWriter` arms a timer around each write
(``prepare``, ``write``, ``write_eof``): when it fires the connection is aborted, which ends the
pending drain, makes every later write (aiohttp's own ``write_eof`` after the handler returns
included) fail at once, and the write raises :class:`ClientWriteTimeout` (a ``ConnectionResetError``,
so callers treat it like a disconnect). With ``handler_cancellation`` the handler may see the
resulting ``CancelledError`` instead; :attr:`ClientWriter.timed_out` tells the two apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvwire.errors import ClientWriteTimeout, ConfigError

logger = logging.getLogger(__name__)

# One bounded write of a whole body. aiohttp waits for the client (drain) once more than 64 KiB went
# out since its last wait, until the transport buffer is below its high-water mark (64 KiB): a write of
# this size waits for the client to take at most about that much.
WRITE_PIECE_BYTES = 64 * 1024


class ClientWriter:
    """One response to one client. Event-loop thread only."""

    def __init__(
        self, request: web.Request, timeout_s: float, what: str = "client",
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"client write timeout must be > 0, got {timeout_s}")
        self._request = request
        self._timeout_s = timeout_s
        self._what = what  # names the request in the log line
        self._on_timeout = on_timeout  # called once when the deadline passes (e.g. to label metrics)
        self._response: web.StreamResponse | None = None
        self.timed_out = False

    @property
    def response(self) -> web.StreamResponse:
        assert self._response is not None, "open() first"
        return self._response

    async def open(self, response: web.StreamResponse) -> web.StreamResponse:
        """Send ``response``'s status line and headers."""
        self._response = response
        await self._bounded(lambda: response.prepare(self._request))
        return response

    async def write(self, data: bytes) -> None:
        await self._bounded(lambda: self.response.write(data))

    async def write_eof(self) -> None:
        await self._bounded(self.response.write_eof)

    async def send_body(self, body: bytes, *, status: int, content_type: str) -> web.StreamResponse:
        """A whole (non-streaming) answer: status, headers with ``Content-Length``, ``body``, written
        here rather than by aiohttp after the handler returned (where no deadline applies), in pieces
        of :data:`WRITE_PIECE_BYTES`, so the deadline cuts off a client that reads nothing, not a slow
        reader of a large body. Returns the finished response."""
        headers = {"Content-Type": content_type}  # as given (an upstream's may carry a charset)
        response: web.StreamResponse
        if len(body) <= WRITE_PIECE_BYTES:
            # one bounded write: aiohttp sends a Response's headers together with its body in write_eof
            response = web.Response(status=status, body=body, headers=headers)
            await self.open(response)
        else:
            response = web.StreamResponse(status=status, headers=headers)
            response.content_length = len(body)
            await self.open(response)
            for start in range(0, len(body), WRITE_PIECE_BYTES):
                await self.write(body[start : start + WRITE_PIECE_BYTES])
        await self.write_eof()
        return response

    async def _bounded(self, write: Callable[[], Awaitable[Any]]) -> None:
        if self.timed_out:
            raise self._error()
        timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire)
        try:
            await write()
        except ConnectionResetError as exc:
            if self.timed_out:
                raise self._error() from exc
            raise
        finally:
            timer.cancel()
        if self.timed_out:  # the abort woke the pending drain without an error
            raise self._error()

    def _error(self) -> ClientWriteTimeout:
        return ClientWriteTimeout(
            f"{self._what}: the client read nothing for {self._timeout_s:g} s (write timeout)"
        )

    def _expire(self) -> None:
        self.timed_out = True
        if self._on_timeout is not None:
            self._on_timeout()
        logger.info("%s: client stopped reading for %g s; aborting its connection", self._what,
                    self._timeout_s)
        transport = self._request.transport
        if transport is not None:
            transport.abort()
