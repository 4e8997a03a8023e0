"""API keys on the HTTP front doors (``kvwire router``, ``kvwire serve``), OpenAI style.

A client proves a key with ``Authorization: Bearer <key>``. A request without a header, with another
scheme, or with a key that is not configured gets **401** and OpenAI's error body
(``{"error": {"message", "type": "invalid_request_error", "param": null, "code": 401, "reason":
"invalid_api_key"}}``: vLLM's shape, ``code`` the HTTP status)
plus ``WWW-Authenticate: Bearer``; nothing else of the request is read. ``/health`` is always open
(load balancers and orchestrators probe it without credentials); ``/metrics`` and ``/instances`` are
protected unless listed in :attr:`ApiKeyConfig.open_paths` (``--open-endpoint``). Keys are compared
in constant time. Refusals are counted by the caller's ``on_refused(reason)`` and logged through a
:class:`RefusalLog` (once per reason, then a summary at most once a minute), so a client hammering
with a wrong key cannot flood the log.

Keys come from ``--api-key`` (repeatable) or, when none is given, the ``KVWIRE_API_KEY`` environment
variable, read once at the CLI edge (:func:`keys_from_cli`).
"""

from __future__ import annotations

import enum
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from kvwire.errors import ConfigError
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
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(token.encode(), key.encode())
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
