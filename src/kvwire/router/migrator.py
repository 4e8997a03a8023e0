"""Surviving a dying instance: re-dispatch before the first byte, migration after it.

:meth:`Migrator.serve` runs one client request through ``dispatch_once`` (the P/D or colocated
path) and, when an instance fails it:

* nothing was sent to the client yet (connection lost, 5xx, refused — also every non-streaming
  request, whose answer is written at the end): dispatch again, from scratch (a new transfer id; the
  dead instance is out of routing already, so a live one is picked);
* the client's stream is open: send the ledger's continuation (prompt + tokens already streamed)
  through ``dispatch_once`` into the same client stream (:mod:`kvwire.router.migration`).

At most ``max_migrations`` moves per request. When no move is left or possible the client gets a
clear error: the upstream's error (non-streaming, or nothing streamed yet) or, in-band, an
OpenAI-style error event followed by ``[DONE]``. See docs/decisions/052.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from kvwire.errors import NoInstanceError
from kvwire.router.client_stream import ClientStream
from kvwire.router.config import RouterConfig
from kvwire.router.metrics import RouterMetrics
from kvwire.router.migration import DONE, StreamInterrupted, StreamLedger
from kvwire.router.request import ClientRequest
from kvwire.router.upstream import UpstreamFailure

log = logging.getLogger(__name__)

DispatchOnce = Callable[[web.Request, ClientRequest], Awaitable[web.StreamResponse]]
# the instance failed, not the request (silent: it stopped heartbeating mid-answer)
_REDISPATCH_KINDS = frozenset({"connect", "disconnect", "http_5xx", "silent"})


def redispatchable(exc: UpstreamFailure) -> bool:
    return exc.kind in _REDISPATCH_KINDS


class Migrator:
    def __init__(self, dispatch_once: DispatchOnce, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self._dispatch_once = dispatch_once
        self._cfg = cfg
        self._metrics = metrics

    def _attach_ledger(self, creq: ClientRequest) -> StreamLedger | None:
        if self._cfg.max_migrations == 0:
            return None
        ledger = StreamLedger.for_request(creq)
        if ledger is not None:
            creq.ledger = ledger
            creq.body["return_token_ids"] = True  # instances tell the ledger the token ids
            creq.raw = msgspec.json.encode(creq.body)
        return ledger

    async def serve(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        ledger = self._attach_ledger(creq)
        current, moves = creq, 0
        failure: UpstreamFailure | None = None  # the last instance failure before a re-dispatch
        while True:
            try:
                return await self._dispatch_once(request, current)
            except StreamInterrupted as exc:
                out, reason = exc.out, exc.reason
            except (UpstreamFailure, NoInstanceError) as exc:
                if current.resume_stream is None:  # nothing went to the client yet
                    if isinstance(exc, NoInstanceError) and failure is not None:
                        raise failure from exc  # nowhere left to go: the client sees what went wrong
                    if moves >= self._cfg.max_migrations or not isinstance(exc, UpstreamFailure) \
                            or not redispatchable(exc):
                        raise
                    failure = exc
                    moves += 1
                    self._metrics.migrations.labels(kind="redispatch").inc()
                    log.warning("re-dispatching request to %s (move %d): %s", creq.path, moves, exc)
                    continue
                out, reason = current.resume_stream, str(exc)
                if not isinstance(exc, UpstreamFailure) or not redispatchable(exc):
                    return await self._give_up(out, ledger, reason, final=True)
            assert ledger is not None
            if ledger.finished:  # the answer is complete; only its end was lost
                await out.write_direct(ledger.tail())
                return await out.close()
            if moves >= self._cfg.max_migrations or not ledger.can_continue():
                return await self._give_up(out, ledger, reason)
            moves += 1
            self._metrics.migrations.labels(kind="stream").inc()
            log.warning("migrating a stream after %d tokens (move %d): %s", len(ledger.token_ids), moves,
                        reason)
            current = ledger.continuation()
            current.resume_stream = out

    async def _give_up(
        self, out: ClientStream, ledger: StreamLedger | None, reason: str, final: bool = False
    ) -> web.StreamResponse:
        if final:
            why = "no instance can continue it"
        else:
            why = "no move left" if ledger is not None and ledger.can_continue() else "cannot be continued"
        await out.error_event(f"failed mid-stream ({why}): {reason}", 502)
        await out.write_direct(DONE)
        return await out.close()
