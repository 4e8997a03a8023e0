"""Dispatch: one client request -> a colocated instance, or a prefill + decode pair.

* colocated (``both`` instances): the body is forwarded untouched to one instance.
* P/D push: a fresh transfer id; P gets a copy with ``max_tokens=1`` (non-streaming), D the full
  request, **concurrently**, each with ``kv_transfer_params`` naming the other's KV endpoints; D's
  answer is streamed back. A streaming answer opens with P's token as soon as P has it, and D's
  stream follows from its second token (:mod:`kvwire.router.splice`, decision 121). If P rejects
  the request (4xx) before D has produced anything, D is cancelled and P's error returned; if P
  refused the connection the pair is re-picked; if P died or failed (5xx), D owns the outcome (it
  recomputes or fails per its failure policy).
* P/D pull: D is picked first and named in P's params (P leases its KV to that D only); P is called
  first; its returned ``kv_transfer_params`` go to D with the role switched to decode.
* policy ``kv_aware`` (push): D first by its cached prefix; P skipped when D holds nearly the whole
  prompt, else told to send only the blocks D lacks (:mod:`kvwire.router.kv_routing`).

Connections refused (the request surely never arrived) are retried on other instances, up to
``max_connect_retries``. Cancellation (client disconnect, or a client that stopped reading and hit
the write deadline) propagates into every upstream call, which closes those connections so that the
instances abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import aiohttp
import msgspec
from aiohttp import web

from kvwire.errors import InvalidRequestError
from kvwire.kv_params import KVTransferParams, Role, TransferMode
from kvwire.kv_signing import ParamsSigner
from kvwire.router.client_body import send_body
from kvwire.router.client_stream import ClientStream
from kvwire.router.config import RouterConfig
from kvwire.router.fallback import FallbackNotice
from kvwire.router.kv_routing import PushPlan, plan_push, prefix_for
from kvwire.router.metrics import RouterMetrics, SSETokenMeter
from kvwire.router.migration import StreamInterrupted
from kvwire.router.migrator import Migrator, redispatchable
from kvwire.router.pd_bodies import decode_body, prefill_body, shared_fields, spliceable
from kvwire.router.prompt_tokens import PromptTokenizer
from kvwire.router.registry import InstanceView
from kvwire.router.request import ClientRequest
from kvwire.router.selection import Plan, Prefix, Selector
from kvwire.router.splice import FirstTokenSplicer
from kvwire.router.upstream import BODY_ERRORS, Upstream, UpstreamFailure

log = logging.getLogger(__name__)

T = TypeVar("T")
Opened = tuple[aiohttp.ClientResponse, bytes]  # response + first body chunk (or the whole body)


class Dispatcher:
    def __init__(self, cfg: RouterConfig, selector: Selector, upstream: Upstream, metrics: RouterMetrics):
        self._cfg = cfg
        self._selector = selector
        self._upstream = upstream
        self._metrics = metrics
        self._tokenizer = PromptTokenizer(cfg.tokenizer)
        self._background: set[asyncio.Task[Any]] = set()
        # With a shared secret every kv_transfer_params is signed (instances refuse unsigned ones).
        self._signer = ParamsSigner(cfg.secret, cfg.kv_params_ttl_s) if cfg.secret else None
        self._fallback = FallbackNotice(metrics.pd_fallback)

    async def dispatch(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        """Serve ``creq``; raises NoInstanceError / ModelNotFoundError / UpstreamFailure before any
        byte went to the client (afterwards failures are reported in-band). An instance that dies
        is survived: re-dispatch before the first byte, migration after (:mod:`.migration`)."""
        return await Migrator(self.dispatch_once, self._cfg, self._metrics).serve(request, creq)

    async def dispatch_once(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        """One dispatch of ``creq`` (a client request or a continuation), no re-dispatch."""
        plan = self._selector.plan(creq.model)
        prefix = prefix_for(self._selector, self._tokenizer, creq)  # token counts for every policy
        if not self._selector.kv_aware:
            prefix = None
        if plan is Plan.COLOCATED:
            return await self._retrying(
                lambda: self._single(request, creq, Role.BOTH, creq.raw, prefix=prefix))
        if plan is Plan.DECODE_ALONE:  # no live P: D serves it colocated (--pd-fallback, decision 124)
            self._fallback.served_alone(creq.model)
            return await self._retrying(
                lambda: self._single(request, creq, Role.DECODE, creq.raw, prefix=prefix))
        if self._cfg.mode is TransferMode.PUSH:
            return await self._retrying(lambda: self._push(request, creq, prefix))
        return await self._pull(request, creq)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=5.0)

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        for i in range(self._cfg.max_connect_retries + 1):
            try:
                return await attempt()
            except UpstreamFailure as exc:
                if not exc.retryable or i == self._cfg.max_connect_retries:
                    raise
                self._metrics.retries.inc()
        raise AssertionError("unreachable")

    # --- one upstream (colocated, or D in pull mode) ---------------------------------------------

    async def _single(
        self, request: web.Request, creq: ClientRequest, role: Role, body: bytes,
        model: str | None = None, prefix: Prefix | None = None, inst: InstanceView | None = None,
    ) -> web.StreamResponse:
        if inst is None:
            inst = self._selector.pick_for(role, model or creq.model, prefix).view
        mode = Plan.COLOCATED if role is Role.BOTH else Plan.DISAGGREGATED
        with self._selector.track(inst.instance_id, creq.est_prompt_tokens + creq.max_new_tokens):
            opened = await self._call(inst, role.value, creq, body, stream=creq.stream)
            return await self._respond(request, creq, inst, opened, mode)

    async def _call(
        self, inst: InstanceView, role: str, creq: ClientRequest, body: bytes, *, stream: bool
    ) -> Opened:
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

    async def _respond(
        self, request: web.Request, creq: ClientRequest, inst: InstanceView, opened: Opened, mode: Plan
    ) -> web.StreamResponse:
        resp, first = opened
        if not creq.stream:
            # Written here, under the deadline, so that P/D calls still running are cancelled on a timeout.
            ctype = resp.headers.get("Content-Type", "application/json")
            return await send_body(request, creq, first, status=resp.status, content_type=ctype,
                                   write_timeout_s=self._cfg.client_write_timeout_s)
        return await self._relay(request, creq, inst, resp, first, mode)

    async def _relay(
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

    # --- P/D ------------------------------------------------------------------------------------

    async def _push(
        self, request: web.Request, creq: ClientRequest, prefix: Prefix | None
    ) -> web.StreamResponse:
        pick = plan_push(self._selector, creq.model, prefix, self._cfg.decode_local_prefill_tokens)
        self._count_kv(pick, prefix)
        d = pick.decode.view
        if pick.prefill is None:  # D holds nearly all of the prompt: it prefills the rest itself
            return await self._single(request, creq, Role.DECODE, creq.raw, inst=d)
        p = pick.prefill.view
        tid = uuid.uuid4().hex
        p_params = self._push_params(tid, Role.PREFILL, peer=d, skip_blocks=pick.skip_blocks)
        d_params = self._push_params(tid, Role.DECODE, peer=p, skip_blocks=pick.skip_blocks)
        early = creq.stream and self._cfg.stream_first_token_from_prefill and spliceable(creq)
        shared = shared_fields(creq) if early else {}
        p_body, d_body = prefill_body(creq, p_params, **shared), decode_body(creq, d_params, **shared)
        prompt = creq.est_prompt_tokens
        with self._selector.track(p.instance_id, prompt - pick.prefill.cached_tokens), \
                self._selector.track(d.instance_id, prompt + creq.max_new_tokens):
            p_task = asyncio.create_task(self._call(p, "prefill", creq, p_body, stream=False))
            d_task = asyncio.create_task(self._call(d, "decode", creq, d_body, stream=creq.stream))
            try:
                if early:
                    response = await self._push_early(request, creq, d, p_task, d_task)
                else:
                    opened = await self._race(p_task, d_task)
                    response = await self._respond(request, creq, d, opened, Plan.DISAGGREGATED)
            except BaseException:
                for task in (p_task, d_task):
                    task.cancel()
                await asyncio.gather(p_task, d_task, return_exceptions=True)
                _close_opened(d_task)
                raise
        self._finish_in_background(p_task, tid)
        return response

    async def _push_early(
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
                    return await self._relay(request, creq, d, resp, held, Plan.DISAGGREGATED)
                pending = asyncio.create_task(self._read_more(d, resp))
            splicer = self._splicer_for(creq, p_task)
            out = None
            if splicer is not None:
                out = await ClientStream(request, creq, self._metrics, Plan.DISAGGREGATED,
                                         write_timeout_s=self._cfg.client_write_timeout_s).open()
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
            return await self._relay(
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

    async def _read_more(self, inst: InstanceView, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await self._upstream.watched(inst, inst.role.value, resp.content.readany())
        except (*BODY_ERRORS, asyncio.TimeoutError) as exc:
            raise self._upstream.lost(inst, inst.role.value, exc) from exc

    def _push_params(
        self, tid: str, role: Role, peer: InstanceView, skip_blocks: int = 0
    ) -> KVTransferParams:
        return self._seal(KVTransferParams(
            transfer_id=tid, mode=TransferMode.PUSH, role=role, peer_endpoints=list(peer.info.kv_endpoints),
            peer_instance_id=peer.instance_id, deadline_s=self._cfg.kv_deadline_s, skip_blocks=skip_blocks,
            peer_kv_layout=peer.info.kv_layout, limit_s=self._cfg.kv_limit_s,
        ))

    def _seal(self, params: KVTransferParams) -> KVTransferParams:
        return params if self._signer is None else self._signer.sign(params)

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

    async def _pull(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        tid = uuid.uuid4().hex
        # D is picked first and named in P's params: P leases its KV to that D only (decision 044).
        d = self._selector.pick(Role.DECODE, creq.model)
        model = creq.model or d.info.model  # P must serve the model D decodes
        p_params = self._seal(KVTransferParams(
            transfer_id=tid, mode=TransferMode.PULL, role=Role.PREFILL,
            peer_endpoints=list(d.info.kv_endpoints), peer_instance_id=d.instance_id,
            deadline_s=self._cfg.kv_deadline_s, limit_s=self._cfg.kv_limit_s,
        ))
        p_body = prefill_body(creq, p_params)
        p, answer = await self._retrying(lambda: self._prefill_only(creq, p_body, model))
        d_body = decode_body(creq, self._params_from_prefill(p, answer))
        picked = [d]  # a retry re-picks; P refuses that D's pull and it recomputes the prompt
        return await self._retrying(lambda: self._single(
            request, creq, Role.DECODE, d_body, model, inst=picked.pop() if picked else None))

    async def _prefill_only(self, creq: ClientRequest, body: bytes, model: str | None
                            ) -> tuple[InstanceView, bytes]:
        p = self._selector.pick(Role.PREFILL, model)
        with self._selector.track(p.instance_id, creq.est_prompt_tokens):
            _, data = await self._call(p, "prefill", creq, body, stream=False)
        return p, data

    def _params_from_prefill(self, p: InstanceView, answer: bytes) -> KVTransferParams:
        try:
            raw = msgspec.json.decode(answer).get("kv_transfer_params")
            params = KVTransferParams.from_dict(raw)
        except (msgspec.DecodeError, AttributeError, InvalidRequestError, RecursionError) as exc:
            self._metrics.upstream_errors.labels(role="prefill", kind="bad_response").inc()
            raise UpstreamFailure(
                f"prefill instance {p.instance_id} returned no valid kv_transfer_params: {exc}",
                status=502, kind="bad_response", instance_id=p.instance_id,
            ) from exc
        endpoints = params.peer_endpoints or list(p.info.kv_endpoints)
        peer_id = params.peer_instance_id or p.instance_id
        if self._signer is not None:  # vouch only for what discovery registered, not for P's answer
            endpoints, peer_id = list(p.info.kv_endpoints), p.instance_id
        return self._seal(msgspec.structs.replace(
            params, role=Role.DECODE, mode=TransferMode.PULL, peer_endpoints=endpoints,
            peer_instance_id=peer_id, peer_kv_layout=params.peer_kv_layout or p.info.kv_layout,
            expires_at=None, sig=None,
        ))


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
