"""Dispatch: one client request -> a colocated instance, or a prefill + decode pair; and every move
it makes when an instance fails. The whole loop is here, in order; its steps are helpers that
return or raise, and never call back into this module:

1. the ledger of a migratable stream is attached (:mod:`kvwire.router.continuation`);
2. a plan is made (:mod:`kvwire.router.selection`): colocated (a ``both`` instance), P/D, or D alone
   when no P is live (``--pd-fallback colocated``, decision 124; counted and logged by
   :mod:`kvwire.router.fallback`); the prompt is tokenized for ``kv_aware`` (:mod:`.kv_routing`);
3. one attempt: P and D picked (D first, P for it, or P skipped) and called concurrently in push
   mode (:mod:`kvwire.router.pd_push`, P's first token opening the stream: :mod:`.splice`,
   decision 121), in order in pull mode (:mod:`kvwire.router.pd_pull`), or one instance called
   (:mod:`kvwire.router.relay`, which also streams every answer to the client);
4. a connection refused (the request surely never arrived) is retried on other instances, up to
   ``max_connect_retries`` (pull mode retries each of its two calls itself);
5. an instance that fails before anything went to the client (connection lost, 5xx, refused, also
   every non-streaming request, whose answer is written at the end) -> dispatched again from step 2
   (a new transfer id; the dead instance is out of routing already);
6. the client's stream is open -> the ledger's continuation (prompt + tokens already streamed) is
   dispatched from step 2 into the same client stream (migration, decision 052).

At most ``max_migrations`` moves (5 and 6) per request. When no move is left or possible the client
gets a clear error: the upstream's error (status and body, decision 122) when nothing was sent yet,
or, in-band, an OpenAI-style error event followed by ``[DONE]``. Cancellation (client disconnect, or
a client that stopped reading and hit the write deadline) propagates into every upstream call, which
closes those connections so that the instances abort the request.
"""

from __future__ import annotations

import logging

from aiohttp import web

from kvwire.errors import NoInstanceError
from kvwire.protocol.kv_params import Role, TransferMode
from kvwire.router.client_stream import ClientStream
from kvwire.router.config import RouterConfig
from kvwire.router.continuation import StreamInterrupted, attach_ledger, give_up, redispatchable, send_tail
from kvwire.router.fallback import FallbackNotice
from kvwire.router.kv_routing import prefix_for
from kvwire.router.metrics import RouterMetrics
from kvwire.router.pd_params import PdParams
from kvwire.router.pd_pull import PullPath
from kvwire.router.pd_push import PushPath
from kvwire.router.prompt_tokens import PromptTokenizer
from kvwire.router.relay import Relay
from kvwire.router.request import ClientRequest
from kvwire.router.selection import Plan, Prefix, Selector
from kvwire.router.stream_ledger import StreamLedger
from kvwire.router.upstream import Upstream, UpstreamFailure

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, cfg: RouterConfig, selector: Selector, upstream: Upstream, metrics: RouterMetrics):
        self._cfg = cfg
        self._selector = selector
        self._metrics = metrics
        self._tokenizer = PromptTokenizer(cfg.tokenizer)
        self._fallback = FallbackNotice(metrics.pd_fallback)
        self._relay = Relay(cfg, selector, upstream, metrics)
        params = PdParams(cfg, metrics)
        self._push = PushPath(cfg, selector, self._relay, params, metrics)
        self._pull = PullPath(cfg, selector, self._relay, params, metrics)

    async def dispatch(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        """Serve ``creq``; raises NoInstanceError / ModelNotFoundError / UpstreamFailure before any
        byte went to the client (afterwards failures are reported in-band). An instance that dies
        is survived: re-dispatch before the first byte, migration after."""
        ledger = attach_ledger(creq, self._cfg.max_migrations)
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
                    return await give_up(out, ledger, reason, final=True)
            assert ledger is not None
            if ledger.finished:  # the answer is complete; only its end was lost
                return await send_tail(out, ledger)
            if moves >= self._cfg.max_migrations or not ledger.can_continue():
                return await give_up(out, ledger, reason)
            moves += 1
            current = self._migrate(ledger, out, reason, moves)

    async def close(self) -> None:
        await self._push.close()

    async def _dispatch_once(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        """One dispatch of ``creq`` (a client request or a continuation): plan, then attempts while
        instances refuse the connection; no re-dispatch."""
        plan = self._selector.plan(creq.model)
        prefix = prefix_for(self._selector, self._tokenizer, creq)  # token counts for every policy
        if not self._selector.kv_aware:
            prefix = None
        if plan is Plan.DECODE_ALONE:  # no live P: D serves it colocated (--pd-fallback, decision 124)
            self._fallback.served_alone(creq.model)
        elif plan is Plan.DISAGGREGATED and self._cfg.mode is TransferMode.PULL:
            return await self._pull.serve(request, creq)  # retries each of its two calls itself
        for attempt in range(self._cfg.max_connect_retries + 1):
            try:
                return await self._attempt(request, creq, plan, prefix)
            except UpstreamFailure as exc:
                if not exc.retryable or attempt == self._cfg.max_connect_retries:
                    raise
                self._metrics.retries.inc()
        raise AssertionError("unreachable")

    async def _attempt(
        self, request: web.Request, creq: ClientRequest, plan: Plan, prefix: Prefix | None
    ) -> web.StreamResponse:
        """Pick the instance(s), call them, relay the answer to the client."""
        if plan is Plan.COLOCATED:
            return await self._relay.single(request, creq, Role.BOTH, creq.raw, prefix=prefix)
        if plan is Plan.DECODE_ALONE:
            return await self._relay.single(request, creq, Role.DECODE, creq.raw, prefix=prefix)
        pick = self._push.pick(creq, prefix)
        if pick.prefill is None:  # D holds nearly all of the prompt: it prefills the rest itself
            return await self._relay.single(request, creq, Role.DECODE, creq.raw, inst=pick.decode.view)
        return await self._push.serve(request, creq, pick.decode.view, pick.prefill, pick.skip_blocks)

    def _migrate(self, ledger: StreamLedger, out: ClientStream, reason: str, moves: int) -> ClientRequest:
        """The continuation of the client's open stream ``out``, to dispatch next."""
        self._metrics.migrations.labels(kind="stream").inc()
        log.warning("migrating a stream after %d tokens (move %d): %s", len(ledger.token_ids), moves,
                    reason)
        current = ledger.continuation()
        current.resume_stream = out
        return current
