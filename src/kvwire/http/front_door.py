"""What every HTTP front door (``kvwire router``, ``kvwire serve``) does to its clients: API keys on the
way in, a deadline on every write on the way out.

**API keys**, OpenAI style. A client proves a key with ``Authorization: Bearer <key>``. A request
without a header, with another scheme, or with a key that is not configured gets **401** and OpenAI's
error body (``{"error": {"message", "type": "invalid_request_error", "param": null, "code": 401,
"reason": "invalid_api_key"}}``: vLLM's shape, ``code`` the HTTP status) plus ``WWW-Authenticate:
Bearer``; nothing else of the request is read. ``/health`` is always open (load balancers and
orchestrators probe it without credentials); ``/metrics`` and ``/instances`` are protected unless
listed in :attr:`ApiKeyConfig.open_paths` (``--open-endpoint``). Keys are compared in constant time.
Refusals are counted by the caller's ``on_refused(reason)`` and logged through a :class:`RefusalLog`
(once per reason, then a summary at most once a minute), so a client hammering with a wrong key
cannot flood the log. Keys come from ``--api-key`` (repeatable) or, when none is given, the
``KVWIRE_API_KEY`` environment variable, read once at the CLI edge (:func:`keys_from_cli`).

**Writes under a deadline** (SSE streams and whole bodies). A client that stops reading but keeps its
connection open fills the socket buffers; aiohttp's ``write`` then waits in ``drain`` for ever.
:class:`ClientWriter` arms a timer around each write (``prepare``, ``write``, ``write_eof``): when it
fires the connection is aborted, which ends the pending drain, makes every later write (aiohttp's own
``write_eof`` after the handler returns included) fail at once, and the write raises
:class:`~kvwire.errors.ClientWriteTimeout` (a ``ConnectionResetError``, so callers treat it like a
disconnect). With ``handler_cancellation`` the handler may see the resulting ``CancelledError``
instead; :attr:`ClientWriter.timed_out` tells the two apart.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from kvwire.errors import ClientWriteTimeout, ConfigError
from kvwire.http.refusal_log import RefusalLog

log = logging.getLogger(__name__)

API_KEY_ENV = "KVWIRE_API_KEY"
HEALTH_PATH = "/health"
MIN_KEY_LEN = 8

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Refusal(str, enum.Enum):
    """Why a request was refused (metric label)."""

    MISSING_KEY = "missing_api_key"  # no Authorization header, or not a Bearer one
    WRONG_KEY = "wrong_api_key"


@dataclass(frozen=True)
class ApiKeyConfig:
    """The keys a front door accepts; empty = no authentication (every path open)."""

    keys: tuple[str, ...] = ()
    open_paths: frozenset[str] = frozenset()  # protected paths made public (besides /health)

    def __post_init__(self) -> None:
        for key in self.keys:
            if len(key) < MIN_KEY_LEN or key != key.strip():
                raise ConfigError(
                    f"an API key must be at least {MIN_KEY_LEN} characters without surrounding spaces"
                )

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def is_open(self, path: str) -> bool:
        return not self.keys or path == HEALTH_PATH or path in self.open_paths

    def check(self, authorization: str | None) -> Refusal | None:
        """None when ``authorization`` (the header value) carries one of the keys, else why not."""
        token = bearer_token(authorization)
        if token is None:
            return Refusal.MISSING_KEY
        # Compare against every key (no early exit) so that timing says nothing about which matched.
        # Header values arrive decoded with surrogateescape (aiohttp): bytes that are not UTF-8 are
        # compared as the bytes they were (a plain ``encode`` would raise: a 500 instead of a 401).
        raw = token.encode("utf-8", "surrogateescape")
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(raw, key.encode("utf-8", "surrogateescape"))
        return None if matched else Refusal.WRONG_KEY


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def bearer_header(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keys_from_cli(flag_values: Iterable[str] | None, env: Mapping[str, str], env_name: str = API_KEY_ENV
                  ) -> tuple[str, ...]:
    """``--api-key`` values, or (none given) the one key in ``env[env_name]``, or none."""
    keys = tuple(flag_values or ())
    if keys:
        return keys
    value = env.get(env_name, "")
    return (value,) if value else ()


def unauthorized_response(refusal: Refusal) -> web.Response:
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        if refusal is Refusal.MISSING_KEY else "Incorrect API key provided."
    )
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": 401, "reason": "invalid_api_key"}}
    return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})


def api_key_middleware(
    config: ApiKeyConfig, on_refused: Callable[[Refusal], None], refusal_log: RefusalLog | None = None
) -> Middleware:
    """aiohttp middleware enforcing ``config`` before any handler runs (the body is never read)."""
    logbook = refusal_log or RefusalLog(log, "HTTP request")

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if config.is_open(request.path):
            return await handler(request)
        refusal = config.check(request.headers.get("Authorization"))
        if refusal is None:
            return await handler(request)
        on_refused(refusal)
        logbook.refused(refusal.value, f"{request.method} {request.path} from {request.remote}")
        return unauthorized_response(refusal)

    return check_api_key


def client_gone(request: web.Request, exc: ConnectionResetError) -> web.Response:
    """What a handler returns when its client went away (or stopped reading): a routine event, logged
    at debug level, not an error. The connection is closed, so aiohttp's write of this reply fails
    quietly (it ignores a ``ConnectionError`` there) and nothing reaches a client that left; the access
    log shows 499, the status proxies use for a client that closed its request."""
    log.debug("%s %s: client gone (%s)", request.method, request.path, exc)
    if request.transport is not None:
        request.transport.close()
    return web.Response(status=499)


# --- writes to a client under a deadline ------------------------------------------------------------

# One bounded write of a whole body. aiohttp waits for the client (drain) once more than 64 KiB went
# out since its last wait, until the transport buffer is below its high-water mark (64 KiB): a write of
# this size waits for the client to take at most about that much.
WRITE_PIECE_BYTES = 64 * 1024


class ClientWriter:
    """One response to one client. Event-loop thread only."""

    def __init__(
        self, request: web.Request, timeout_s: float, what: str = "client",
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"client write timeout must be > 0, got {timeout_s}")
        self._request = request
        self._timeout_s = timeout_s
        self._what = what  # names the request in the log line
        self._on_timeout = on_timeout  # called once when the deadline passes (e.g. to label metrics)
        self._response: web.StreamResponse | None = None
        self.timed_out = False

    @property
    def response(self) -> web.StreamResponse:
        assert self._response is not None, "open() first"
        return self._response

    async def open(self, response: web.StreamResponse) -> web.StreamResponse:
        """Send ``response``'s status line and headers."""
        self._response = response
        await self._bounded(lambda: response.prepare(self._request))
        return response

    async def write(
        self, data: bytes, *, opening: web.StreamResponse | None = None, last: bool = False
    ) -> None:
        """Write ``data`` (each step under the deadline): ``opening``: first send that response's status
        line and headers (:meth:`open`); ``last``: then end the response (:meth:`write_eof`). A
        streaming handler's whole use of the writer is these calls."""
        if opening is not None:
            await self.open(opening)
        if data:
            await self._bounded(lambda: self.response.write(data))
        if last:
            await self.write_eof()

    async def write_eof(self) -> None:
        await self._bounded(self.response.write_eof)

    async def send_body(self, body: bytes, *, status: int, content_type: str) -> web.StreamResponse:
        """A whole (non-streaming) answer: status, headers with ``Content-Length``, ``body``, written
        here rather than by aiohttp after the handler returned (where no deadline applies), in pieces
        of :data:`WRITE_PIECE_BYTES`, so the deadline cuts off a client that reads nothing, not a slow
        reader of a large body. Returns the finished response."""
        headers = {"Content-Type": content_type}  # as given (an upstream's may carry a charset)
        response: web.StreamResponse
        if len(body) <= WRITE_PIECE_BYTES:
            # one bounded write: aiohttp sends a Response's headers together with its body in write_eof
            response = web.Response(status=status, body=body, headers=headers)
            await self.open(response)
        else:
            response = web.StreamResponse(status=status, headers=headers)
            response.content_length = len(body)
            await self.open(response)
            for start in range(0, len(body), WRITE_PIECE_BYTES):
                await self.write(body[start : start + WRITE_PIECE_BYTES])
        await self.write_eof()
        return response

    async def _bounded(self, write: Callable[[], Awaitable[Any]]) -> None:
        if self.timed_out:
            raise self._error()
        timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire)
        try:
            await write()
        except ConnectionResetError as exc:
            if self.timed_out:
                raise self._error() from exc
            raise
        finally:
            timer.cancel()
        if self.timed_out:  # the abort woke the pending drain without an error
            raise self._error()

    def _error(self) -> ClientWriteTimeout:
        return ClientWriteTimeout(
            f"{self._what}: the client read nothing for {self._timeout_s:g} s (write timeout)"
        )

    def _expire(self) -> None:
        self.timed_out = True
        if self._on_timeout is not None:
            self._on_timeout()
        log.info("%s: client stopped reading for %g s; aborting its connection", self._what,
                    self._timeout_s)
        transport = self._request.transport
        if transport is not None:
            transport.abort()
