"""A whole (non-streaming) answer from the router to the client, written under the write deadline.

Returning a ``web.Response`` would let aiohttp write the body after the handler returned, with no
deadline: a client that never reads a body larger than the socket buffers would hold the request for
ever. :func:`send_body` writes it in the handler instead, through
:class:`kvwire.client_writer.ClientWriter`, in pieces of :data:`WRITE_PIECE_BYTES` so that the deadline
means "the client read (almost) nothing for ``client_write_timeout_s``", not "the whole body took
that long" (a slow reader of a large answer is not cut off). On a timeout the request's outcome
becomes ``client_timeout`` and a ``ConnectionResetError`` unwinds the dispatch like a disconnect
(upstream calls still in flight are cancelled).
"""

from __future__ import annotations

from aiohttp import web

from kvwire.client_writer import ClientWriter
from kvwire.router.client_stream import CLIENT_TIMEOUT
from kvwire.router.request import ClientRequest

# One bounded write. aiohttp waits for the client (drain) once more than 64 KiB went out since its last
# wait, until the transport buffer is below its high-water mark (64 KiB): a write of this size waits
# for the client to take at most about that much.
WRITE_PIECE_BYTES = 64 * 1024


async def send_body(
    request: web.Request, creq: ClientRequest, body: bytes, *, status: int, content_type: str,
    write_timeout_s: float,
) -> web.StreamResponse:
    """Send status, headers (with ``Content-Length``) and ``body``; returns the finished response.

    Event-loop thread, inside the handler. Raises :class:`~kvwire.errors.ClientWriteTimeout` (a
    ``ConnectionResetError``) when the client stops reading, ``ConnectionResetError`` when it is gone.
    """

    def timed_out() -> None:
        creq.outcome = CLIENT_TIMEOUT

    writer = ClientWriter(request, write_timeout_s, f"router request to {creq.path}", on_timeout=timed_out)
    headers = {"Content-Type": content_type}
    response: web.StreamResponse
    if len(body) <= WRITE_PIECE_BYTES:
        # One bounded write: aiohttp sends a Response's headers together with its body in write_eof.
        response = web.Response(body=body, status=status, headers=headers)
        await writer.open(response)
    else:
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = len(body)
        await writer.open(response)
        for start in range(0, len(body), WRITE_PIECE_BYTES):
            await writer.write(body[start:start + WRITE_PIECE_BYTES])
    await writer.write_eof()
    return response
