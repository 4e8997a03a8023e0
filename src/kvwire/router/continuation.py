"""Continuing an answer whose instance failed: which failures move, and how a move ends.

The dispatcher (:mod:`kvwire.router.dispatcher`) owns the loop that moves a request; this module
holds what that loop asks:

* :func:`attach_ledger`: a migratable streaming request gets a :class:`StreamLedger` (and instances
  are asked for token ids) before its first dispatch;
* :class:`StreamInterrupted`: raised by the relay when the upstream stream broke after the client's
  stream was opened (the ledger then continues the answer elsewhere);
* :func:`redispatchable`: the failures that are the instance's, not the request's;
* :func:`send_tail` / :func:`give_up`: how the client's open stream ends when the answer is complete
  but its end was lost, or when no move is left or possible (an OpenAI-style error event, then
  ``[DONE]``). See docs/decisions/052.

No I/O except writing to the client's stream; nothing here calls the dispatcher.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvwire.router.client_stream import ClientStream
from kvwire.router.request import ClientRequest
from kvwire.router.stream_ledger import DONE, StreamLedger
from kvwire.router.upstream import UpstreamFailure

# the instance failed, not the request (silent: it stopped heartbeating mid-answer)
_REDISPATCH_KINDS = frozenset({"connect", "disconnect", "http_5xx", "silent"})


class StreamInterrupted(Exception):
    """The upstream stream broke after the client's stream was opened (raised by the relay)."""

    def __init__(self, out: ClientStream, reason: str) -> None:
        super().__init__(reason)
        self.out = out
        self.reason = reason


def redispatchable(exc: UpstreamFailure) -> bool:
    return exc.kind in _REDISPATCH_KINDS


def attach_ledger(creq: ClientRequest, max_migrations: int) -> StreamLedger | None:
    """The ledger of ``creq``'s stream when it may migrate (else None); instances are then asked
    for the token ids the ledger needs (``return_token_ids``)."""
    if max_migrations == 0:
        return None
    ledger = StreamLedger.for_request(creq)
    if ledger is not None:
        creq.ledger = ledger
        creq.body["return_token_ids"] = True  # instances tell the ledger the token ids
        creq.raw = msgspec.json.encode(creq.body)
    return ledger


async def send_tail(out: ClientStream, ledger: StreamLedger) -> web.StreamResponse:
    """The answer is complete and only its end was lost: the usage event (if asked) and ``[DONE]``."""
    await out.write_direct(ledger.tail())
    return await out.close()


async def give_up(
    out: ClientStream, ledger: StreamLedger | None, reason: str, final: bool = False
) -> web.StreamResponse:
    """End the client's open stream with an error event and ``[DONE]``."""
    if final:
        why = "no instance can continue it"
    else:
        why = "no move left" if ledger is not None and ledger.can_continue() else "cannot be continued"
    await out.error_event(f"failed mid-stream ({why}): {reason}", 502)
    await out.write_direct(DONE)
    return await out.close()
