"""HTTP calls from the router to instances, with failures classified once.

Every failure becomes an :class:`UpstreamFailure` (an :class:`~kvwire.errors.UpstreamError`) that
says what the client should see (status, body), whether the request certainly never reached the
instance (``retryable``: the connection was refused), and whether the instance looks dead (then it is
marked unreachable in the registry until its next heartbeat).

Cancellation: cancelling a coroutine of this module (client disconnect) closes the upstream
connection, so the instance sees the disconnect and aborts the request.

Silence: a read from an instance that stops heartbeating meanwhile (hung, stopped, partitioned: its
registry entry expires, or a new epoch replaced it) is abandoned within ``SILENCE_CHECK_S`` of the
expiry with kind ``silent``, instead of waiting for the whole-request timeout (decision 052).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import msgspec

from kvwire.errors import INSTANCE_GONE_CODES, ConfigError, UpstreamError
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import InstanceState, InstanceView, Registry

log = logging.getLogger(__name__)

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
            if uncancel is not None:
                uncancel()
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
