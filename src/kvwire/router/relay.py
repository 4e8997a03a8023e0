"""One instance's answer to the client: call an instance, then write its answer to the client.

A non-streaming answer is read whole and written under the client's write deadline
(:mod:`kvwire.router.client_body`); a stream is forwarded event by event, byte for byte unless a
:class:`~kvwire.router.splice.FirstTokenSplicer` trims P's first token off D's start (decision 121),
through the request's :class:`~kvwire.router.client_stream.ClientStream` (and its ledger).

Failure: before the client's stream is open, an :class:`~kvwire.router.upstream.UpstreamFailure`
is raised (the dispatcher retries, re-dispatches or reports it). Afterwards a broken stream of a
migratable request raises :class:`~kvwire.router.continuation.StreamInterrupted` (the dispatcher
continues it elsewhere); any other stream ends with an in-band error event. Cancellation closes the
upstream connection, so that the instance aborts the request. Event-loop thread; calls nothing back.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kvwire.protocol.kv_params import Role
from kvwire.router.client_body import send_body
from kvwire.router.client_stream import ClientStream
from kvwire.router.config import RouterConfig
from kvwire.router.continuation import StreamInterrupted
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import InstanceView
from kvwire.router.request import ClientRequest
from kvwire.router.selection import Plan, Prefix, Selector
from kvwire.router.splice import FirstTokenSplicer
from kvwire.router.upstream import BODY_ERRORS, Upstream, UpstreamFailure

Opened = tuple[aiohttp.ClientResponse, bytes]  # response + first body chunk (or the whole body)


class Relay:
    def __init__(self, cfg: RouterConfig, selector: Selector, upstream: Upstream, metrics: RouterMetrics):
        self._cfg = cfg
        self._selector = selector
        self._upstream = upstream
        self._metrics = metrics

    async def single(
        self, request: web.Request, creq: ClientRequest, role: Role, body: bytes,
        model: str | None = None, prefix: Prefix | None = None, inst: InstanceView | None = None,
    ) -> web.StreamResponse:
        """Serve ``creq`` from one instance (``inst``, or one picked for ``role``): colocated, D alone,
        D when P is skipped, or D in pull mode."""
        if inst is None:
            inst = self._selector.pick_for(role, model or creq.model, prefix).view
        mode = Plan.COLOCATED if role is Role.BOTH else Plan.DISAGGREGATED
        with self._selector.track(inst.instance_id, creq.est_prompt_tokens + creq.max_new_tokens):
            opened = await self.call(inst, role.value, creq, body, stream=creq.stream)
            return await self.respond(request, creq, inst, opened, mode)

    async def call(
        self, inst: InstanceView, role: str, creq: ClientRequest, body: bytes, *, stream: bool
    ) -> Opened:
        """POST ``body``; the whole answer, or (streaming) the response and its first chunk."""
        if not stream:
            return await self._upstream.read_all(inst, role, creq.path, body, creq.headers)
        resp = await self._upstream.open(inst, role, creq.path, body, creq.headers)
        try:
            first = await self._upstream.watched(inst, role, resp.content.readany())
        except (*BODY_ERRORS, asyncio.TimeoutError) as exc:
            resp.close()
            raise self._upstream.lost(inst, role, exc) from exc
        except BaseException:
            resp.close()
            raise
        return resp, first

    async def read_more(self, inst: InstanceView, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await self._upstream.watched(inst, inst.role.value, resp.content.readany())
        except (*BODY_ERRORS, asyncio.TimeoutError) as exc:
            raise self._upstream.lost(inst, inst.role.value, exc) from exc

    async def open_stream(self, request: web.Request, creq: ClientRequest, mode: Plan) -> ClientStream:
        """The client's stream, opened (200, ``text/event-stream``) before any upstream byte."""
        return await ClientStream(request, creq, self._metrics, mode,
                                  write_timeout_s=self._cfg.client_write_timeout_s).open()

    async def respond(
        self, request: web.Request, creq: ClientRequest, inst: InstanceView, opened: Opened, mode: Plan
    ) -> web.StreamResponse:
        resp, first = opened
        if not creq.stream:
            # Written here, under the deadline, so that P/D calls still running are cancelled on a timeout.
            ctype = resp.headers.get("Content-Type", "application/json")
            return await send_body(request, creq, first, status=resp.status, content_type=ctype,
                                   write_timeout_s=self._cfg.client_write_timeout_s)
        return await self.relay(request, creq, inst, resp, first, mode)

    async def relay(
        self, request: web.Request, creq: ClientRequest, inst: InstanceView,
        resp: aiohttp.ClientResponse, first: bytes, mode: Plan,
        out: ClientStream | None = None, splicer: FirstTokenSplicer | None = None,
    ) -> web.StreamResponse:
        """Forward an SSE stream (byte for byte unless ``splicer`` trims P's token off its start)."""
        try:
            out = out or creq.resume_stream
            if out is None:
                ctype = resp.headers.get("Content-Type", "text/event-stream")
                out = await ClientStream(request, creq, self._metrics, mode, status=resp.status,
                                         content_type=ctype, write_timeout_s=self._cfg.client_write_timeout_s,
                                         ).open()
            chunk = first
            while chunk:
                await out.write(splicer.filter(chunk) if splicer is not None else chunk)
                if splicer is not None and splicer.diverged:
                    return await self._diverged(out, inst)
                chunk = await self._upstream.watched(inst, inst.role.value, resp.content.readany())
            if splicer is not None:
                await out.write(splicer.flush())
            if out.ledger is not None and out.ledger.interrupted:
                reason = out.ledger.error or "stream ended early"
                raise StreamInterrupted(out, f"{inst.role.value} instance {inst.instance_id}: {reason}")
        except (*BODY_ERRORS, asyncio.TimeoutError, UpstreamFailure) as exc:
            assert out is not None
            failure = exc if isinstance(exc, UpstreamFailure) else self._upstream.lost(inst, inst.role.value,
                                                                                        exc)
            if out.ledger is not None:
                raise StreamInterrupted(out, str(failure)) from exc
            await out.error_event(f"failed mid-stream: {failure}", failure.status)
        finally:
            if resp.content.at_eof():
                resp.release()  # keep the connection for the next request
            else:
                resp.close()  # drop the connection so that the instance aborts the request
        return await out.close()

    async def _diverged(self, out: ClientStream, inst: InstanceView) -> web.StreamResponse:
        """D's answer does not continue the first token P streamed (it recomputed the prompt, or
        sampled differently): the answer continues from P's token elsewhere (migration), or, when
        the request cannot migrate, ends with an error event. D's connection is closed (aborted)."""
        reason = f"decode instance {inst.instance_id} did not continue the prefill's first token"
        self._metrics.upstream_errors.labels(role="decode", kind="diverged").inc()
        if out.ledger is not None:
            raise StreamInterrupted(out, reason)
        await out.error_event(reason, 502)
        return await out.close()
