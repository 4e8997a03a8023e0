"""The aiohttp application: routes, OpenAI-style error bodies, health, models and metrics.

Generation endpoints live in :mod:`kvwire.server.generate`. Errors become HTTP statuses here, once:
an unknown route or method, an oversized body and any unexpected exception all get the OpenAI
error body (``{"error": {"message", "type", "param", "code"}}``), never an empty reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvwire.auth import ApiKeyConfig, Refusal, api_key_middleware
from kvwire.refusal_log import RefusalLog
from kvwire.server.engine_loop import EngineLoop
from kvwire.server.engine_status import EngineHealth
from kvwire.server.generate import GenerationHandler, error_response
from kvwire.server.metrics import CONTENT_TYPE, ServerMetrics
from kvwire.supervision import HealthBoard

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        default_type = "invalid_request_error" if exc.status < 500 else "server_error"
        err_type = _ERROR_TYPES.get(exc.status, default_type)
        return error_response(exc.status, exc.reason if exc.text is None else exc.text, err_type)
    except Exception as exc:  # the one place an unexpected error becomes an HTTP status
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error")


class ServerApp:
    """Holds what the routes need. Built on the event loop's thread; one per process."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        generation: GenerationHandler,
        metrics: ServerMetrics,
        model_name: str,
        max_model_len: int,
        identity: dict[str, Any] | None = None,
        *,
        board: HealthBoard | None = None,
    ) -> None:
        self._engine_loop = engine_loop
        self._generation = generation
        self._metrics = metrics
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._created = int(time.time())
        # Shown by /health: instance id, role, KV endpoints (what registration advertises).
        self._identity = dict(identity or {})
        self._board = board  # the instance's supervised threads: a dead one makes /health 503

    def build(self, max_request_bytes: int, api_keys: ApiKeyConfig | None = None) -> web.Application:
        auth = api_key_middleware(api_keys or ApiKeyConfig(), self._auth_refused,
                                  RefusalLog(logger, "HTTP request"))
        app = web.Application(client_max_size=max_request_bytes, middlewares=[auth, _errors_as_json])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kvwire/transfers", self.transfers)
        app.router.add_post("/v1/completions", self._generation.completions)
        app.router.add_post("/v1/chat/completions", self._generation.chat)
        return app

    def _auth_refused(self, refusal: Refusal) -> None:
        self._metrics.refused.labels(reason=refusal.value).inc()

    async def health(self, request: web.Request) -> web.Response:
        if self._generation.draining:
            return web.json_response({"status": "shutting down", **self._identity}, status=503)
        status = self._engine_loop.status()
        if status.health is not EngineHealth.OK:
            body = {"status": status.health.value, "reason": status.reason, **self._identity}
            return web.json_response(body, status=503)
        dead = self._board.health_body() if self._board is not None else None
        if dead is not None:  # e.g. the heartbeat thread gave up: serving, but not registered
            return web.json_response({**dead, **self._identity}, status=503)
        return web.json_response({"status": "ok", **self._identity})

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self._model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "kvwire",
            "root": self._model_name,
            "parent": None,
            "max_model_len": self._max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def transfers(self, request: web.Request) -> web.Response:
        """The last completed KV transfers of this instance's connector, per side, as
        ``{"send": [[bytes, seconds], ...], "recv": [...]}`` (exact percentiles for ``kvwire bench
        serve``; empty lists on a colocated instance)."""
        del request
        from kvwire.connector.metrics import registered_connector_metrics

        metrics = registered_connector_metrics(self._metrics.registry)
        snapshot = metrics.recent.snapshot() if metrics is not None else {"send": [], "recv": []}
        return web.json_response(snapshot)
