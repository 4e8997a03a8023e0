"""One instance's answer to the client: call an instance, then write its answer to the client.

In order: :class:`Relay` (what the dispatcher calls), then what it is made of: the HTTP calls to
instances with their failures classified once (:class:`Upstream`), the client's metered SSE stream
(:class:`ClientStream`, :class:`SSETokenMeter`), a whole answer under the write deadline
(:func:`send_body`), and P's first token spliced onto D's stream (:class:`FirstTokenSplicer`).

A non-streaming answer is read whole and written under the client's write deadline
(:func:`send_body`); a stream is forwarded event by event, byte for byte unless a
:class:`FirstTokenSplicer` trims P's first token off D's start (decision 121), through the request's
:class:`ClientStream` (and its ledger, :class:`kvwire.router.request.StreamLedger`).

Failure: before the client's stream is open, an :class:`UpstreamFailure` is raised (the dispatcher
retries, re-dispatches or reports it). Afterwards a broken stream of a migratable request raises
:class:`StreamInterrupted` (the dispatcher continues it elsewhere); any other stream ends with an
in-band error event. Cancellation closes the upstream connection, so that the instance aborts the
request. Event-loop thread; calls nothing back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web

from kvwire.errors import INSTANCE_GONE_CODES, ConfigError, UpstreamError
from kvwire.http.front_door import ClientWriter
from kvwire.protocol.kv_params import Role
from kvwire.router.config import RouterConfig
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import InstanceState, InstanceView, Registry
from kvwire.router.request import ClientRequest, Outcome, StreamLedger
from kvwire.router.selection import Plan, Prefix, Selector

log = logging.getLogger(__name__)

Opened = tuple[aiohttp.ClientResponse, bytes]  # response + first body chunk (or the whole body)


class StreamInterrupted(Exception):
    """The upstream stream broke after the client's stream was opened (raised by the relay)."""

    def __init__(self, out: ClientStream, reason: str) -> None:
        super().__init__(reason)
        self.out = out
        self.reason = reason


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


# --- calls to instances ------------------------------------------------------------------------------
# HTTP calls from the router to instances, with failures classified once.
#
# Every failure becomes an :class:`UpstreamFailure` (an :class:`~kvwire.errors.UpstreamError`) that
# says what the client should see (status, body), whether the request certainly never reached the
# instance (``retryable``: the connection was refused), and whether the instance looks dead (then it is
# marked unreachable in the registry until its next heartbeat).
#
# Cancellation: cancelling a coroutine of :class:`Upstream` (client disconnect) closes the upstream
# connection, so the instance sees the disconnect and aborts the request.
#
# Silence: a read from an instance that stops heartbeating meanwhile (hung, stopped, partitioned: its
# registry entry expires, or a new epoch replaced it) is abandoned within ``SILENCE_CHECK_S`` of the
# expiry with kind ``silent``, instead of waiting for the whole-request timeout (decision 052).

MAX_ERROR_BODY_BYTES = 64 * 1024
BODY_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)
_DEAD_STATUSES = frozenset({502, 504})  # a gateway in front of the instance says it is gone
SILENCE_CHECK_S = 1.0  # how often a pending read checks that its instance still heartbeats
# An instance that refuses connections within YOUNG_S of registering is probably still starting its
# HTTP server (a host that registers early): when it is the only one of its role, the request waits
# for it up to YOUNG_HOLD_S instead of taking it out of routing and failing with 503.
YOUNG_S = 10.0
YOUNG_HOLD_S = 3.0
YOUNG_RETRY_S = 0.1
T = TypeVar("T")


class UpstreamFailure(UpstreamError):
    """An upstream call failed. ``body``/``content_type``/``retry_after``: the upstream's own error
    body and its Retry-After header, passed on."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        kind: str,
        instance_id: str,
        retryable: bool = False,
        body: bytes | None = None,
        content_type: str = "application/json",
        retry_after: str | None = None,
    ) -> None:
        super().__init__(message, status=status, kind=kind)
        self.instance_id = instance_id
        self.retryable = retryable
        self.body = body
        self.content_type = content_type
        self.retry_after = retry_after  # the instance's Retry-After (a full waiting queue's 429), passed on


@dataclass(frozen=True)
class UpstreamLimits:
    """Connections the router opens to instances: in all, and to one instance (host:port). A request
    beyond waits for a free one (within its timeout), counted in
    ``kvwire_router_upstream_connection_waits_total``."""

    max_connections: int = 4096
    max_connections_per_instance: int = 1024

    def __post_init__(self) -> None:
        if self.max_connections <= 0 or self.max_connections_per_instance <= 0:
            raise ConfigError(f"upstream connection limits must be > 0, got {self}")


class Upstream:
    """Shared client session; one per router app (created inside the running event loop)."""

    def __init__(
        self, registry: Registry, metrics: RouterMetrics, connect_timeout_s: float, total_s: float, *,
        limits: UpstreamLimits | None = None,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=connect_timeout_s)
        limits = limits or UpstreamLimits()
        connector = aiohttp.TCPConnector(
            limit=limits.max_connections, limit_per_host=limits.max_connections_per_instance,
            keepalive_timeout=30.0, enable_cleanup_closed=True,
        )
        trace = aiohttp.TraceConfig()
        trace.on_connection_queued_start.append(self._connection_queued)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=True,
                                             trace_configs=[trace])

    async def _connection_queued(self, session: object, context: object, params: object) -> None:
        """aiohttp signal: a request waits for a connection (a connection limit is reached)."""
        self._metrics.upstream_connection_waits.inc()

    async def close(self) -> None:
        await self.session.close()

    async def open(
        self, inst: InstanceView, role: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """POST and return the response once its headers are in and its status is < 400."""
        held_until = asyncio.get_running_loop().time() + YOUNG_HOLD_S
        while True:
            try:
                resp = await self.session.post(inst.url + path, data=body, headers=headers)
                break
            except aiohttp.ClientConnectorError as exc:
                if self._young(inst) and asyncio.get_running_loop().time() < held_until:
                    await asyncio.sleep(YOUNG_RETRY_S)  # hold the request: it is probably still starting
                    continue
                detail = f"cannot connect: {exc}"
                raise self._failure(inst, role, "connect", detail, dead=True, retryable=True) from exc
            except (*BODY_ERRORS, asyncio.TimeoutError) as exc:
                raise self.lost(inst, role, exc) from exc
        if resp.status >= 400:
            raise await self._http_failure(inst, role, resp)
        return resp

    def _young(self, inst: InstanceView) -> bool:
        """Registered moments ago and the only live one of its role: worth waiting for (with others
        alive the refused request is retried on one of them at once instead)."""
        view = self._registry.get(inst.instance_id)
        others = [v for v in self._registry.live(inst.role) if v.instance_id != inst.instance_id]
        return view is not None and view.info.epoch == inst.info.epoch and not others and \
            self._registry.registered_for_s(view) < YOUNG_S

    async def read_all(
        self, inst: InstanceView, role: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """POST and read the whole (successful) body."""
        resp = await self.open(inst, role, path, body, headers)
        try:
            data = await self.watched(inst, role, resp.read())
        except (*BODY_ERRORS, asyncio.TimeoutError) as exc:
            resp.close()
            raise self.lost(inst, role, exc) from exc
        except BaseException:
            resp.close()  # cancelled: drop the connection so the instance aborts
            raise
        return resp, data

    async def watched(self, inst: InstanceView, role: str, read: Awaitable[T]) -> T:
        """Await ``read`` (a read of ``inst``'s answer); raise an UpstreamFailure (kind ``silent``)
        once ``inst`` stopped heartbeating (expired, or replaced by a new epoch) meanwhile.

        No task per read: a timer checks the registry every ``SILENCE_CHECK_S`` and cancels the
        awaiting task when the instance went silent (microseconds per read)."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        timer: list[asyncio.TimerHandle] = []  # the pending check
        silent: list[bool] = []

        def check() -> None:
            if self._silent(inst):
                silent.append(True)
                task.cancel()
            else:
                timer[0] = loop.call_later(SILENCE_CHECK_S, check)

        timer.append(loop.call_later(SILENCE_CHECK_S, check))
        try:
            return await read
        except asyncio.CancelledError:
            if not silent:
                raise
            uncancel = getattr(task, "uncancel", None)  # Python >= 3.11: undo our own cancel()
            if uncancel is not None and uncancel() > 0:
                raise  # the handler was cancelled too (its client went away): that wins, no re-dispatch
            raise self._failure(inst, role, "silent", "stopped heartbeating mid-answer", status=504) from None
        finally:
            timer[0].cancel()

    def _silent(self, inst: InstanceView) -> bool:
        view = self._registry.get(inst.instance_id)
        return view is None or view.state is InstanceState.EXPIRED or view.info.epoch != inst.info.epoch

    async def _http_failure(
        self, inst: InstanceView, role: str, resp: aiohttp.ClientResponse
    ) -> UpstreamFailure:
        try:
            body = await resp.content.read(MAX_ERROR_BODY_BYTES)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            body = b""
        finally:
            resp.close()
        kind = "http_4xx" if resp.status < 500 else "http_5xx"
        text = body.decode("utf-8", "replace").strip() or "(empty body)"
        failure = self._failure(
            inst, role, kind, f"status {resp.status}: {text[:500]}", status=resp.status,
            dead=resp.status in _DEAD_STATUSES or _says_gone(resp.status, body), body=body or None,
            content_type=resp.headers.get("Content-Type", "application/json"),
        )
        failure.retry_after = resp.headers.get("Retry-After")
        return failure

    def lost(self, inst: InstanceView, role: str, exc: BaseException) -> UpstreamFailure:
        """Classify (and count) a failure past connecting: timeout, or the instance went away."""
        if isinstance(exc, asyncio.TimeoutError):
            return self._failure(inst, role, "timeout", "no answer in time", status=504)
        return self._failure(inst, role, "disconnect", f"connection lost: {exc!r}", dead=True)

    def _failure(
        self,
        inst: InstanceView,
        role: str,
        kind: str,
        detail: str,
        *,
        status: int = 502,
        dead: bool = False,
        retryable: bool = False,
        body: bytes | None = None,
        content_type: str = "application/json",
    ) -> UpstreamFailure:
        self._metrics.upstream_errors.labels(role=role, kind=kind).inc()
        if dead:
            self._registry.mark_unreachable(inst.instance_id, inst.info.epoch, f"{kind}: {detail}")
        message = f"{role} instance {inst.instance_id} ({inst.url}) failed: {detail}"
        log.warning("%s", message)
        return UpstreamFailure(
            message, status=status, kind=kind, instance_id=inst.instance_id,
            retryable=retryable, body=body, content_type=content_type,
        )


def _says_gone(status: int, body: bytes) -> bool:
    """A 503 whose error code says the instance serves nothing more (lost a tensor-parallel rank,
    shutting down): out of routing now, so a re-dispatch picks another one."""
    if status != 503:
        return False
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError, RecursionError):
        return False
    if not isinstance(error, dict):
        return False
    # ``reason`` (vLLM's shape: ``code`` is the status); ``code`` from instances before 2026-12-05.
    # Only strings are looked up: an upstream's list or object there is not hashable.
    return any(
        isinstance(error.get(key), str) and error[key] in INSTANCE_GONE_CODES for key in ("reason", "code")
    )


# --- the client's stream -----------------------------------------------------------------------------
# The SSE stream from the router to the client: prepared once, metered (TTFT/ITL) as it is written.
#
# Every write has a deadline (``client_write_timeout_s``): a client that stops reading is cut off
# (:class:`kvwire.http.front_door.ClientWriter`), the request's outcome becomes ``client_timeout``
# and the write raises a ``ConnectionResetError`` that unwinds the relay like a disconnect (upstream
# calls closed).
# Non-streaming answers get the same deadline through :func:`send_body`.


class ClientStream:
    """Wraps a ``web.StreamResponse``; :meth:`write` times each event that carries generated text."""

    def __init__(
        self, request: web.Request, creq: ClientRequest, metrics: RouterMetrics, mode: Plan,
        *, write_timeout_s: float, status: int = 200, content_type: str = "text/event-stream",
    ) -> None:
        self._creq = creq
        # Label children resolved once: write() runs per token event.
        self._ttft = metrics.ttft.labels(mode=mode.value)
        self._itl = metrics.itl.labels(mode=mode.value)
        self.response = web.StreamResponse(
            status=status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        self._writer = ClientWriter(request, write_timeout_s, f"router request to {creq.path}",
                                    on_timeout=self._timed_out)
        self._meter = SSETokenMeter()
        self._last: float | None = None

    def _timed_out(self) -> None:
        self._creq.outcome = Outcome.CLIENT_TIMEOUT

    async def open(self) -> ClientStream:
        await self._writer.open(self.response)
        return self

    @property
    def ledger(self) -> StreamLedger | None:
        return self._creq.ledger

    async def write(self, chunk: bytes) -> None:
        """Write upstream bytes (through the request's ledger, when it has one)."""
        if self._creq.ledger is not None:
            chunk = self._creq.ledger.filter(chunk)
        if not chunk:
            return
        await self._writer.write(chunk)
        n = self._meter.feed(chunk)
        if not n:
            return
        now = time.perf_counter()
        if self._last is None:
            self._ttft.observe(now - self._creq.t0)
        else:
            self._itl.observe(now - self._last)
        for _ in range(n - 1):
            self._itl.observe(0.0)
        self._last = now

    async def write_direct(self, data: bytes) -> None:
        """Write router-made bytes (no ledger, no metering)."""
        await self._writer.write(data)

    async def error_event(self, message: str, status: int) -> None:
        """Report a failure in-band (the status line is gone already), OpenAI style."""
        if self._creq.outcome is not Outcome.CLIENT_TIMEOUT:
            self._creq.outcome = Outcome.UPSTREAM_ERROR
        event = {"error": {"message": message, "type": "upstream_error", "code": status}}
        await self._writer.write(b"data: " + msgspec.json.encode(event) + b"\n\n")

    async def close(self) -> web.StreamResponse:
        await self._writer.write_eof()
        return self.response


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[object] | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)


_event_decoder = msgspec.json.Decoder(_Event)


def _has_token(data: bytes) -> bool:
    try:
        event = _event_decoder.decode(data)
    except Exception:  # DecodeError, ValidationError, RecursionError: an event we cannot read
        return False
    for choice in event.choices:
        if choice.text:
            return True
        d = choice.delta
        if d is not None and (d.content or d.reasoning_content or d.tool_calls):
            return True
    return False


class SSETokenMeter:
    """Counts SSE events that carry generated text in a byte stream fed chunk by chunk.

    Only reads a copy of the stream (the router forwards the bytes unchanged). Events split across
    chunks are reassembled; role-only, usage-only and ``[DONE]`` events do not count.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> int:
        self._buf += chunk
        *events, self._buf = self._buf.replace(b"\r\n", b"\n").split(b"\n\n")
        n = 0
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload != b"[DONE]" and _has_token(payload):
                        n += 1
        return n


# --- a whole answer to the client --------------------------------------------------------------------
# A whole (non-streaming) answer from the router to the client, written under the write deadline.
#
# Returning a ``web.Response`` would let aiohttp write the body after the handler returned, with no
# deadline: a client that never reads a body larger than the socket buffers would hold the request for
# ever. :func:`send_body` writes it in the handler instead, through
# :class:`kvwire.http.front_door.ClientWriter` (``send_body``), in bounded pieces so that the deadline
# means "the client read (almost) nothing for ``client_write_timeout_s``", not "the whole body took
# that long" (a slow reader of a large answer is not cut off). On a timeout the request's outcome
# becomes ``client_timeout`` and a ``ConnectionResetError`` unwinds the dispatch like a disconnect
# (upstream calls still in flight are cancelled).


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


# --- P's first token, spliced onto D's stream --------------------------------------------------------
# Streaming P's first token at once (push mode, the default): the client stream's first event comes
# from P's ``max_tokens=1`` answer, and the same token is then removed from the start of D's stream.
#
# Pure byte/JSON logic, no I/O. Only D's first events are rewritten; once P's token has been matched,
# the rest of D's stream passes through byte for byte. P and D answer under one id (the router gives
# both the same ``request_id``), so the client sees one stream.
#
# Matching is exact when the answers carry token ids (``return_token_ids``, which the router asks for
# on every migratable stream): D's leading ids must be P's, and its leading text P's text. When D
# differs (it recomputed, or sampled another token), :attr:`FirstTokenSplicer.diverged` is set and
# :meth:`FirstTokenSplicer.filter` withholds D's stream from that event on: the router then continues
# the answer from P's token elsewhere (a migration, decision 052), so that the client never sees a
# duplicate or a missing token. Without ids (text only) a mismatch stops splicing and D's events pass
# unchanged (logged). See docs/decisions/041 and 121.

# Fields of D's first event that the early events already carried, or that the router's ledger reads.
_PROMPT_IDS = "prompt_token_ids"
_BUDGET = "kvwire_max_tokens"


def _first_choice(answer: dict[str, Any]) -> dict[str, Any] | None:
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return choices[0]


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    return None


class FirstTokenSplicer:
    """Contract: :meth:`early_events` once, then D's bytes in order through :meth:`filter`, then
    :meth:`flush`. Event-loop thread, one per request."""

    def __init__(
        self, text: str, chat: bool, base: dict[str, Any], token_ids: list[int] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.text = text  # P's first token, as text
        self.token_ids = token_ids  # P's first token's id(s), when P returned them
        self._prompt_ids = prompt_ids
        self._chat = chat
        self._base = base  # id / object / created / model for the synthesized events
        self._matched = 0  # characters of ``text`` found at the start of D's stream so far
        self._ids_matched = 0
        self._done = False
        self.diverged = False  # D's stream does not continue P's token (ids known): withheld
        self._buf = b""

    @classmethod
    def from_prefill(cls, answer_bytes: bytes, chat: bool) -> FirstTokenSplicer | None:
        """A splicer for P's non-streaming answer, or None when it has no single non-empty text."""
        try:
            answer = msgspec.json.decode(answer_bytes)
        except (msgspec.DecodeError, RecursionError):
            return None
        if not isinstance(answer, dict) or (choice := _first_choice(answer)) is None:
            return None
        message = choice.get("message")
        text = (message.get("content") if isinstance(message, dict) else None) if chat else choice.get("text")
        if not isinstance(text, str) or not text:
            return None
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": answer.get("id", "cmpl-kvwire"), "object": obj, "created": answer.get("created", 0),
                "model": answer.get("model", "")}
        ids = _int_list(choice.get("token_ids"))
        prompt_ids = _int_list(answer.get(_PROMPT_IDS)) or _int_list(choice.get(_PROMPT_IDS))  # kvwire, vLLM
        return cls(text, chat, base, ids or None, prompt_ids)

    def early_events(self) -> bytes:
        """The SSE bytes to send the client now (chat: role chunk, then the token)."""
        token: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        if self._chat:
            token["delta"] = {"content": self.text}
        else:
            token["text"] = self.text
        if self.token_ids is not None:
            token["token_ids"] = self.token_ids
        first = dict(self._base)
        if self._prompt_ids is not None:
            first[_PROMPT_IDS] = self._prompt_ids
        if not self._chat:
            return _sse(dict(first, choices=[token]))
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        return _sse(dict(first, choices=[role])) + _sse(dict(self._base, choices=[token]))

    def filter(self, chunk: bytes) -> bytes:
        """D's bytes with P's token removed from the start (events may be split across chunks)."""
        if self._done:
            return b"" if self.diverged else chunk
        self._buf += chunk
        out: list[bytes] = []
        while not self._done:
            end = _event_end(self._buf)
            if end < 0:
                break
            event, self._buf = self._buf[:end], self._buf[end:]
            out.append(self._event(event))
        if self._done:
            if not self.diverged:
                out.append(self._buf)
            self._buf = b""
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return b"" if self.diverged else rest

    def _event(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            return event
        try:
            data = msgspec.json.decode(line[5:].strip())
            choice = data["choices"][0]
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, RecursionError):
            return event  # usage-only or foreign events pass unchanged
        if not isinstance(choice, dict):
            return event
        delta = choice.get("delta") if self._chat else None
        if self._chat:
            if not isinstance(delta, dict):
                return event  # a chat event without a delta object: not one to trim
            text = delta.get("content")
        else:
            text = choice.get("text")
        text = text if isinstance(text, str) else ""
        if self._chat and isinstance(delta, dict) and delta.pop("role", None) is not None and not text:
            return self._emit(data, choice, "")  # the role chunk went out with the early events
        return self._trim(data, choice, text, event)

    def _trim(self, data: dict[str, Any], choice: dict[str, Any], text: str, event: bytes) -> bytes:
        ids = _int_list(choice.get("token_ids"))
        keep_ids = self._match_ids(ids) if self.token_ids is not None and ids is not None else ids
        keep = self._match_text(text) if not self.diverged else None
        if keep is None:
            if self.token_ids is None:  # text only: cannot tell; pass D's stream on (decision 041)
                log.warning("decode output does not start with the prefill token %r; splicing stopped",
                            self.text)
                self._done = True
                return event
            self.diverged = self._done = True
            return b""
        if self._matched == len(self.text) and (self.token_ids is None or
                                                 self._ids_matched == len(self.token_ids)):
            self._done = True
        if keep_ids is not None:
            choice["token_ids"] = keep_ids
        return self._emit(data, choice, keep)

    def _match_ids(self, ids: list[int]) -> list[int] | None:
        assert self.token_ids is not None
        need = self.token_ids[self._ids_matched:]
        n = min(len(need), len(ids))
        if ids[:n] != need[:n]:
            self.diverged = True
            return None
        self._ids_matched += n
        return ids[n:]

    def _match_text(self, text: str) -> str | None:
        """What is left of ``text`` after P's text; None when it does not continue P's."""
        remaining = self.text[self._matched:]
        if remaining.startswith(text):
            self._matched += len(text)
            return ""
        if text.startswith(remaining):
            self._matched = len(self.text)
            return text[len(remaining):]
        return None

    def _emit(self, data: dict[str, Any], choice: dict[str, Any], keep: str) -> bytes:
        data.pop(_PROMPT_IDS, None)  # sent with the early events
        if not keep and not choice.get("token_ids") and choice.get("finish_reason") is None \
                and not data.get("usage") and _BUDGET not in data:
            return b""  # nothing left to say in this event
        if self._chat:
            choice["delta"] = {"content": keep} if keep or choice.get("finish_reason") is None else {}
        else:
            choice["text"] = keep
        return _sse(data)


def _event_end(buf: bytes) -> int:
    """Index just past the first complete SSE event in ``buf`` (LF or CRLF line ends), or -1.

    An event is relayed as soon as its blank line arrives: looking for LF-only separators would hold a
    CRLF stream back until its end.
    """
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buf.find(sep)) >= 0]
    return min(ends, default=-1)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"
