"""A whole (non-streaming) answer from the router to the client, written under the write deadline.

Returning a ``web.Response`` would let aiohttp write the body after the handler returned, with no
deadline: a client that never reads a body larger than the socket buffers would hold the request for
ever. :func:`send_body` writes it in the handler instead, through
:class:`kvwire.http.front_door.ClientWriter` (``send_body``), in bounded pieces so that the deadline
means "the client read (almost) nothing for ``client_write_timeout_s``", not "the whole body took
that long" (a slow reader of a large answer is not cut off). On a timeout the request's outcome
becomes ``client_timeout`` and a ``ConnectionResetError`` unwinds the dispatch like a disconnect
(upstream calls still in flight are cancelled).
"""

from __future__ import annotations

from aiohttp import web

from kvwire.http.front_door import ClientWriter
from kvwire.router.request import ClientRequest, Outcome


async def send_body(
    request: web.Request, creq: ClientRequest, body: bytes, *, status: int, content_type: str,
    write_timeout_s: float,
) -> web.StreamResponse:
    """Send status, headers (with ``Content-Length``) and ``body``; returns the finished response.

    Event-loop thread, inside the handler. Raises :class:`~kvwire.errors.ClientWriteTimeout` (a
    ``ConnectionResetError``) when the client stops reading, ``ConnectionResetError`` when it is gone.
    """

    def timed_out() -> None:
        creq.outcome = Outcome.CLIENT_TIMEOUT

    writer = ClientWriter(request, write_timeout_s, f"router request to {creq.path}", on_timeout=timed_out)
    return await writer.send_body(body, status=status, content_type=content_type)
