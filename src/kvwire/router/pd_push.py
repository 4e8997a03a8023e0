"""P/D push: P and D picked, called concurrently, and D's answer (opened by P's first token) relayed.

A fresh transfer id; P gets a copy with ``max_tokens=1`` (non-streaming), D the full request,
**concurrently**, each with ``kv_transfer_params`` naming the other's KV endpoints; D's answer is
streamed back. A streaming answer opens with P's token as soon as P has it, and D's stream follows
from its second token (:mod:`kvwire.router.splice`, decision 121). If P rejects the request (4xx)
before D has produced anything, D is cancelled and P's error raised; if P refused the connection
the error is raised too (the dispatcher re-picks the pair); if P died or failed (5xx), D owns the
outcome (it recomputes or fails per its failure policy). Policy ``kv_aware``: D first by its cached
prefix, P told to send only the blocks D lacks, or skipped (:mod:`kvwire.router.kv_routing`).

P's call outlives the client's answer when D finishes first: it is finished in the background
(cancelled on :meth:`PushPath.close`). Event-loop thread; calls nothing back.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, cast

import aiohttp
from aiohttp import web

from kvwire.protocol.kv_params import Role
from kvwire.router.config import RouterConfig
from kvwire.router.continuation import StreamInterrupted, redispatchable
from kvwire.router.kv_routing import PushPlan, plan_push
from kvwire.router.metrics import RouterMetrics, SSETokenMeter
from kvwire.router.pd_bodies import decode_body, prefill_body, shared_fields, spliceable
from kvwire.router.pd_params import PdParams
from kvwire.router.registry import InstanceView
from kvwire.router.relay import Opened, Relay
from kvwire.router.request import ClientRequest
from kvwire.router.selection import Picked, Plan, Prefix, Selector
from kvwire.router.splice import FirstTokenSplicer
from kvwire.router.upstream import UpstreamFailure

log = logging.getLogger(__name__)


class PushPath:
    def __init__(
        self, cfg: RouterConfig, selector: Selector, relay: Relay, params: PdParams, metrics: RouterMetrics
    ) -> None:
        self._cfg = cfg
        self._selector = selector
        self._relay = relay
        self._params = params
        self._metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()  # P calls that outlived their answer

    def pick(self, creq: ClientRequest, prefix: Prefix | None) -> PushPlan:
        """D, then P for it (or no P: D holds nearly all of the prompt); KV hits counted."""
        pick = plan_push(self._selector, creq.model, prefix, self._cfg.decode_local_prefill_tokens)
        self._count_kv(pick, prefix)
        return pick

    async def serve(
        self, request: web.Request, creq: ClientRequest, d: InstanceView, prefill: Picked, skip_blocks: int
    ) -> web.StreamResponse:
        """Call P (``prefill``) and D concurrently; answer the client from D (opened by P's token)."""
        p = prefill.view
        tid = uuid.uuid4().hex
        p_params = self._params.push(tid, Role.PREFILL, peer=d, skip_blocks=skip_blocks)
        d_params = self._params.push(tid, Role.DECODE, peer=p, skip_blocks=skip_blocks)
        early = creq.stream and self._cfg.stream_first_token_from_prefill and spliceable(creq)
        shared = shared_fields(creq) if early else {}
        p_body, d_body = prefill_body(creq, p_params, **shared), decode_body(creq, d_params, **shared)
        prompt = creq.est_prompt_tokens
        with self._selector.track(p.instance_id, prompt - prefill.cached_tokens), \
                self._selector.track(d.instance_id, prompt + creq.max_new_tokens):
            p_task = asyncio.create_task(self._relay.call(p, "prefill", creq, p_body, stream=False))
            d_task = asyncio.create_task(self._relay.call(d, "decode", creq, d_body, stream=creq.stream))
            try:
                if early:
                    response = await self._first_token_from_p(request, creq, d, p_task, d_task)
                else:
                    opened = await self._race(p_task, d_task)
                    response = await self._relay.respond(request, creq, d, opened, Plan.DISAGGREGATED)
            except BaseException:
                for task in (p_task, d_task):
                    task.cancel()
                await asyncio.gather(p_task, d_task, return_exceptions=True)
                _close_opened(d_task)
                raise
        self._finish_in_background(p_task, tid)
        return response

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=5.0)

    async def _first_token_from_p(
        self, request: web.Request, creq: ClientRequest, d: InstanceView,
        p_task: asyncio.Task[Opened], d_task: asyncio.Task[Opened],
    ) -> web.StreamResponse:
        """Streaming push where P's token, if P answers before D has streamed any token, goes out at once.

        D's token-less bytes (headers, a chat role chunk) are held back meanwhile; if D streams a token
        first, or P fails, D's stream is relayed as usual.
        """
        held, resp, pending = b"", None, cast("asyncio.Task[Any]", d_task)
        probe = SSETokenMeter()
        try:
            while True:
                await asyncio.wait({pending, p_task}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    break  # P answered first
                resp, chunk = _take(pending.result(), resp)
                held += chunk
                if not chunk or probe.feed(chunk):  # D streamed a token (or ended) first: no splicing
                    return await self._relay.relay(request, creq, d, resp, held, Plan.DISAGGREGATED)
                pending = asyncio.create_task(self._relay.read_more(d, resp))
            splicer = self._splicer_for(creq, p_task)
            out = None
            if splicer is not None:
                out = await self._relay.open_stream(request, creq, Plan.DISAGGREGATED)
                await out.write(splicer.early_events())
                self._metrics.first_tokens_from_prefill.inc()
            try:
                resp, chunk = _take(await pending, resp)
            except UpstreamFailure as exc:
                if out is None:
                    raise
                if redispatchable(exc):  # D died before its first byte: continue after P's token elsewhere
                    raise StreamInterrupted(out, str(exc)) from exc
                await out.error_event(str(exc), exc.status)
                return await out.close()
            return await self._relay.relay(
                request, creq, d, resp, held + chunk, Plan.DISAGGREGATED, out=out, splicer=splicer
            )
        except BaseException:
            pending.cancel()
            if resp is not None:
                resp.close()
            raise

    def _splicer_for(self, creq: ClientRequest, p_task: asyncio.Task[Opened]) -> FirstTokenSplicer | None:
        p_exc = p_task.exception()
        if isinstance(p_exc, UpstreamFailure) and _fatal_for_pair(p_exc):
            raise p_exc
        if p_exc is not None:
            log.warning("prefill failed (%s); decode instance recovers per its policy", p_exc)
            return None
        return FirstTokenSplicer.from_prefill(p_task.result()[1], creq.path.endswith("/chat/completions"))

    def _count_kv(self, pick: PushPlan, prefix: Prefix | None) -> None:
        if prefix is None:
            return
        n = len(prefix.token_ids)
        self._metrics.kv_prompt_tokens.labels(role="decode").inc(n)
        self._metrics.kv_hit_tokens.labels(role="decode").inc(pick.decode.cached_tokens)
        if pick.prefill is None:
            self._metrics.skipped_prefills.inc()
            return
        self._metrics.kv_prompt_tokens.labels(role="prefill").inc(n)
        self._metrics.kv_hit_tokens.labels(role="prefill").inc(pick.prefill.cached_tokens)
        if pick.partial:
            self._metrics.partial_transfers.inc()

    async def _race(self, p_task: asyncio.Task[Opened], d_task: asyncio.Task[Opened]) -> Opened:
        """D's first bytes (or whole answer), unless P fails first in a way D cannot recover from.

        P refused the connection (never got the request: the pair is re-picked) or rejected the request
        (4xx: D would too) -> D is cancelled and P's error raised. P died or answered 5xx -> D carries
        on: its connector sees the transfer fail and recomputes or fails with a clear error (its policy).
        """
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        p_exc = p_task.exception() if p_task in done else None
        if d_task not in done and isinstance(p_exc, UpstreamFailure) and _fatal_for_pair(p_exc):
            d_task.cancel()
            await asyncio.gather(d_task, return_exceptions=True)
            raise p_exc
        if p_exc is not None:
            log.warning("prefill failed (%s); decode instance recovers per its policy", p_exc)
        try:
            return await d_task
        except BaseException:
            p_task.cancel()  # D is gone: P's transfer has nowhere to go
            raise

    def _finish_in_background(self, p_task: asyncio.Task[Opened], tid: str) -> None:
        if p_task.done():
            _consume(p_task, tid)
            return
        self._background.add(p_task)

        def done(task: asyncio.Task[Opened]) -> None:
            self._background.discard(task)
            _consume(task, tid)

        p_task.add_done_callback(done)


def _take(result: Opened | bytes, resp: aiohttp.ClientResponse | None) -> Opened:
    """(response, chunk) from either D's opening call or a later read of its body."""
    if isinstance(result, tuple):
        return result
    assert resp is not None
    return resp, result


def _fatal_for_pair(exc: UpstreamFailure) -> bool:
    return exc.retryable or exc.kind == "http_4xx"


def _consume(task: asyncio.Task[Opened], tid: str) -> None:
    """Retrieve a finished prefill call's outcome (already logged and counted where it failed)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.info("prefill of transfer %s failed after decode started: %s", tid, exc)


def _close_opened(task: asyncio.Task[Opened]) -> None:
    if task.done() and not task.cancelled() and task.exception() is None:
        task.result()[0].close()
