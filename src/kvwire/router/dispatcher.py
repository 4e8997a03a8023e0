"""Dispatch: one client request -> a colocated instance, or a prefill + decode pair; and every move
it makes when an instance fails. The whole loop is :class:`Dispatcher`, first, in order; then, in
the order the loop reaches them, how a move ends, one P/D attempt in push mode (:class:`PushPath`)
and in pull mode (:class:`PullPath`), the ``kv_transfer_params`` and bodies P and D are sent, and the
P/D fallback notice. None of these call back into the loop: they return or raise.

1. the ledger of a migratable stream is attached (:func:`kvwire.router.request.attach_ledger`);
2. a plan is made (:mod:`kvwire.router.selection`): colocated (a ``both`` instance), P/D, or D alone
   when no P is live (``--pd-fallback colocated``, decision 124; counted and logged by
   :class:`FallbackNotice`); the prompt is tokenized for ``kv_aware``;
3. one attempt: P and D picked (D first, P for it, or P skipped) and called concurrently in push
   mode (:class:`PushPath`, P's first token opening the stream: decision 121), in order in pull mode
   (:class:`PullPath`), or one instance called (:class:`kvwire.router.relay.Relay`, which also
   streams every answer to the client);
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

import asyncio
import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import Counter

from kvwire.errors import InvalidRequestError, NoInstanceError
from kvwire.http.refusal_log import LogThrottle
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from kvwire.protocol.kv_signing import ParamsSigner
from kvwire.router.config import RouterConfig
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import InstanceView
from kvwire.router.relay import (
    ClientStream,
    FirstTokenSplicer,
    Opened,
    Relay,
    SSETokenMeter,
    StreamInterrupted,
    Upstream,
    UpstreamFailure,
)
from kvwire.router.request import DONE, ClientRequest, StreamLedger, attach_ledger
from kvwire.router.selection import (
    Plan,
    Prefix,
    PromptTokenizer,
    PushPlan,
    Selector,
    plan_push,
    prefix_for,
)

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
            self._push.count_kv(pick, prefix)
            return await self._relay.single(request, creq, Role.DECODE, creq.raw, inst=pick.decode.view)
        return await self._push.serve(request, creq, pick, prefix)

    def _migrate(self, ledger: StreamLedger, out: ClientStream, reason: str, moves: int) -> ClientRequest:
        """The continuation of the client's open stream ``out``, to dispatch next."""
        self._metrics.migrations.labels(kind="stream").inc()
        log.warning("migrating a stream after %d tokens (move %d): %s", len(ledger.token_ids), moves,
                    reason)
        current = ledger.continuation()
        current.resume_stream = out
        return current


# --- how a move ends ---------------------------------------------------------------------------
# Which failures move (:func:`redispatchable`: the instance's, not the request's), and how the
# client's open stream ends when the answer is complete but its end was lost (:func:`send_tail`), or
# when no move is left or possible (:func:`give_up`: an OpenAI-style error event, then ``[DONE]``).
# See docs/decisions/052. No I/O except writing to the client's stream.

# the instance failed, not the request (silent: it stopped heartbeating mid-answer)
_REDISPATCH_KINDS = frozenset({"connect", "disconnect", "http_5xx", "silent"})


def redispatchable(exc: UpstreamFailure) -> bool:
    return exc.kind in _REDISPATCH_KINDS


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


# --- one P/D attempt, push mode ----------------------------------------------------------------------
# P/D push: P and D picked, called concurrently, and D's answer (opened by P's first token) relayed.
#
# A fresh transfer id; P gets a copy with ``max_tokens=1`` (non-streaming), D the full request,
# **concurrently**, each with ``kv_transfer_params`` naming the other's KV endpoints; D's answer is
# streamed back. A streaming answer opens with P's token as soon as P has it, and D's stream follows
# from its second token (:mod:`kvwire.router.relay`, decision 121). If P rejects the request (4xx)
# before D has produced anything, D is cancelled and P's error raised; if P refused the connection
# the error is raised too (the dispatcher re-picks the pair); if P died or failed (5xx), D owns the
# outcome (it recomputes or fails per its failure policy). Policy ``kv_aware``: D first by its cached
# prefix, P told to send only the blocks D lacks, or skipped (:mod:`kvwire.router.selection`).
#
# P's call outlives the client's answer when D finishes first: it is finished in the background
# (cancelled on :meth:`PushPath.close`). Event-loop thread; calls nothing back.



class _PdPath:
    """What both P/D paths are built from: the router's config, picks, calls, parameters, metrics."""

    def __init__(
        self, cfg: RouterConfig, selector: Selector, relay: Relay, params: PdParams, metrics: RouterMetrics
    ) -> None:
        self._cfg = cfg
        self._selector = selector
        self._relay = relay
        self._params = params
        self._metrics = metrics


class PushPath(_PdPath):
    def __init__(
        self, cfg: RouterConfig, selector: Selector, relay: Relay, params: PdParams, metrics: RouterMetrics
    ) -> None:
        super().__init__(cfg, selector, relay, params, metrics)
        self._background: set[asyncio.Task[Any]] = set()  # P calls that outlived their answer

    def pick(self, creq: ClientRequest, prefix: Prefix | None) -> PushPlan:
        """D, then P for it (or no P: D holds nearly all of the prompt); KV hits are counted by
        :meth:`serve` (or, without P, by the caller: :meth:`count_kv`)."""
        return plan_push(self._selector, creq.model, prefix, self._cfg.decode_local_prefill_tokens)

    async def serve(
        self, request: web.Request, creq: ClientRequest, pick: PushPlan, prefix: Prefix | None
    ) -> web.StreamResponse:
        """Call P and D (``pick``) concurrently; answer the client from D (opened by P's token).

        P's request goes out first: D's parameters are signed and its body built, and the pick's
        KV hits counted, once P's call has run up to its first wait (its request written, or its
        connection being made). That work was on the first token's path (decision 167)."""
        d, prefill, skip_blocks = pick.decode.view, pick.prefill, pick.skip_blocks
        assert prefill is not None
        p = prefill.view
        tid = uuid.uuid4().hex
        p_params = self._params.push(tid, Role.PREFILL, peer=d, skip_blocks=skip_blocks)
        early = creq.stream and self._cfg.stream_first_token_from_prefill and spliceable(creq)
        shared = shared_fields(creq) if early else {}
        p_body = prefill_body(creq, p_params, **shared)
        prompt = creq.est_prompt_tokens
        with self._selector.track(p.instance_id, prompt - prefill.cached_tokens), \
                self._selector.track(d.instance_id, prompt + creq.max_new_tokens):
            p_task = asyncio.create_task(self._relay.call(p, "prefill", creq, p_body, stream=False))
            d_task: asyncio.Task[Opened] | None = None
            try:
                await asyncio.sleep(0)  # P's call runs up to its first wait
                d_params = self._params.push(tid, Role.DECODE, peer=p, skip_blocks=skip_blocks)
                d_body = decode_body(creq, d_params, **shared)
                d_task = asyncio.create_task(self._relay.call(d, "decode", creq, d_body, stream=creq.stream))
                self.count_kv(pick, prefix)
                if early:
                    response = await self._first_token_from_p(request, creq, d, p_task, d_task)
                else:
                    opened = await self._race(p_task, d_task)
                    response = await self._relay.respond(request, creq, d, opened, Plan.DISAGGREGATED)
            except BaseException:
                tasks = [t for t in (p_task, d_task) if t is not None]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if d_task is not None:
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

    def count_kv(self, pick: PushPlan, prefix: Prefix | None) -> None:
        """The pick's KV hits (``kv_aware``), in the router's metrics."""
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


# --- one P/D attempt, pull mode ----------------------------------------------------------------------
# P/D pull: D picked first and named in P's params (P leases its KV to that D only, decision 044);
# P is called first; the ``kv_transfer_params`` P returns go to D with the role switched to decode.
#
# Each of the two calls is retried on another instance when its instance refused the connection (the
# request surely never arrived), up to ``max_connect_retries``; a D retry re-picks D, which P then
# refuses to serve its pull, so that D recomputes the prompt. Event-loop thread; calls nothing back.

T = TypeVar("T")


class PullPath(_PdPath):
    async def serve(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        tid = uuid.uuid4().hex
        # D is picked first and named in P's params: P leases its KV to that D only (decision 044).
        d = self._selector.pick(Role.DECODE, creq.model)
        model = creq.model or d.info.model  # P must serve the model D decodes
        p_body = prefill_body(creq, self._params.pull_prefill(tid, d))
        p, answer = await self._retrying(lambda: self._prefill_only(creq, p_body, model))
        d_body = decode_body(creq, self._params.pull_decode(p, answer))
        picked = [d]  # a retry re-picks; P refuses that D's pull and it recomputes the prompt
        return await self._retrying(lambda: self._relay.single(
            request, creq, Role.DECODE, d_body, model, inst=picked.pop() if picked else None))

    async def _prefill_only(self, creq: ClientRequest, body: bytes, model: str | None
                            ) -> tuple[InstanceView, bytes]:
        p = self._selector.pick(Role.PREFILL, model)
        with self._selector.track(p.instance_id, creq.est_prompt_tokens):
            _, data = await self._relay.call(p, "prefill", creq, body, stream=False)
        return p, data

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt``, again while its instance refuses the connection (``max_connect_retries``)."""
        for i in range(self._cfg.max_connect_retries + 1):
            try:
                return await attempt()
            except UpstreamFailure as exc:
                if not exc.retryable or i == self._cfg.max_connect_retries:
                    raise
                self._metrics.retries.inc()
        raise AssertionError("unreachable")


# --- the kv_transfer_params P and D get --------------------------------------------------------------
# The ``kv_transfer_params`` the router gives P and D: minted per transfer, signed with the shared
# secret when there is one (instances then refuse unsigned ones; decision 043). Only these ever reach
# an instance: a client's own are dropped on parsing (:mod:`kvwire.router.request`, decision 124).
# No I/O; event-loop thread.


class PdParams:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self._cfg = cfg
        self._metrics = metrics
        # With a shared secret every kv_transfer_params is signed (instances refuse unsigned ones).
        self._signer = ParamsSigner(cfg.secret, cfg.kv_params_ttl_s) if cfg.secret else None

    def push(self, tid: str, role: Role, peer: InstanceView, skip_blocks: int = 0) -> KVTransferParams:
        """Push mode: ``role``'s params naming ``peer``'s KV endpoints."""
        return self._seal(KVTransferParams(
            transfer_id=tid, mode=TransferMode.PUSH, role=role, peer_endpoints=list(peer.info.kv_endpoints),
            peer_instance_id=peer.instance_id, deadline_s=self._cfg.kv_deadline_s, skip_blocks=skip_blocks,
            peer_kv_layout=peer.info.kv_layout, limit_s=self._cfg.kv_limit_s,
        ))

    def pull_prefill(self, tid: str, d: InstanceView) -> KVTransferParams:
        """Pull mode: P's params, naming the D it leases its KV to (decision 044)."""
        return self._seal(KVTransferParams(
            transfer_id=tid, mode=TransferMode.PULL, role=Role.PREFILL,
            peer_endpoints=list(d.info.kv_endpoints), peer_instance_id=d.instance_id,
            deadline_s=self._cfg.kv_deadline_s, limit_s=self._cfg.kv_limit_s,
        ))

    def pull_decode(self, p: InstanceView, answer: bytes) -> KVTransferParams:
        """Pull mode: D's params, from those P returned (role switched to decode); an
        :class:`UpstreamFailure` (502, ``bad_response``) when P's answer holds none that are valid."""
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

    def _seal(self, params: KVTransferParams) -> KVTransferParams:
        return params if self._signer is None else self._signer.sign(params)


# --- the bodies P and D get --------------------------------------------------------------------------
# What P and D are sent in push and pull mode: P's one-token copy of the request, D's copy, and
# the fields both get when P's first token opens the client's stream (decision 121). Pure functions of
# the client's request; no I/O.


def prefill_body(creq: ClientRequest, params: KVTransferParams, **shared: Any) -> bytes:
    """P's copy of the request: one token, non-streaming, with its kv_transfer_params."""
    return creq.derived_body(
        max_tokens=1, max_completion_tokens=1, stream=False, stream_options=None, min_tokens=None,
        kv_transfer_params=params.to_dict(), **shared,
    )


def decode_body(creq: ClientRequest, params: KVTransferParams, **shared: Any) -> bytes:
    return creq.derived_body(kv_transfer_params=params.to_dict(), **shared)


# Request fields that make P's one-token answer something other than a stream's first event.
_NOT_SPLICEABLE = ("logprobs", "top_logprobs", "echo", "prompt_logprobs")


def spliceable(creq: ClientRequest) -> bool:
    """Whether P's first token can open the client's stream: a new request (not a continuation),
    one choice, no log-probabilities or echo (P's answer would carry them differently)."""
    body = creq.body
    if creq.resume_stream is not None or body.get("n") not in (None, 1):
        return False
    if body.get("best_of") not in (None, 1):
        return False
    return not any(body.get(key) not in (None, False, 0) for key in _NOT_SPLICEABLE)


def shared_fields(creq: ClientRequest) -> dict[str, Any]:
    """Fields P and D both get when P's first token opens the stream: one ``request_id`` (vLLM's
    field: both answer under the same id) and, for a sampled request without a seed, one random
    ``seed`` (both draw the same first token from the same logits, so D continues P's)."""
    body = creq.body
    rid = body.get("request_id")
    shared: dict[str, Any] = {"request_id": rid if isinstance(rid, str) and rid else uuid.uuid4().hex}
    if body.get("seed") is None and body.get("temperature") not in (0, 0.0):
        shared["seed"] = secrets.randbits(31)
    return shared


# --- P/D fallback notice -----------------------------------------------------------------------------
# P/D fallback (``--pd-fallback colocated``, decision 124): a model with a live decode instance but no
# live prefill instance is served by D alone, as a colocated request, rather than refused with a 503.
#
# Each such request is counted (``kvwire_router_pd_fallback_total``); the warning is logged once per
# model, then at most once per ``interval_s`` with the count since (a cluster whose P is down would
# otherwise log every request).



class FallbackNotice:
    """Counts and warns about requests served by D alone. Event-loop thread only."""

    def __init__(self, counter: Counter, interval_s: float = 60.0) -> None:
        self._counter = counter
        self._throttle = LogThrottle(interval_s)  # per model

    def served_alone(self, model: str | None) -> None:
        self._counter.inc()
        more = self._throttle.due(model)
        if more is None:
            return
        since = f" ({more} more since the last warning)" if more else ""
        log.warning("no live prefill instance for model %r: a decode instance serves the request alone, "
                    "prefill included (--pd-fallback colocated)%s", model, since)
