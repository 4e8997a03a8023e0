"""The aiohttp application: routes, health, models and metrics.

Generation endpoints live in :mod:`kvwire.server.generate`, and so does the middleware that turns
every error into an OpenAI error body (:func:`~kvwire.server.generate.errors_as_json`): an unknown
route or method, an oversized body and any unexpected exception all get one, never an empty reply.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from kvwire.http.front_door import ApiKeyConfig, Refusal, api_key_middleware
from kvwire.http.refusal_log import RefusalLog
from kvwire.server.engine_loop import EngineHealth, EngineLoop
from kvwire.server.generate import GenerationHandler, errors_as_json
from kvwire.server.metrics import CONTENT_TYPE, ServerMetrics
from kvwire.server.tokenize import TokenizeHandlers
from kvwire.supervision import HealthBoard

logger = logging.getLogger(__name__)


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
        self._api_keys = ApiKeyConfig()  # set by build(): /health shows the identity to key holders only

    def build(self, max_request_bytes: int, api_keys: ApiKeyConfig | None = None) -> web.Application:
        self._api_keys = api_keys or ApiKeyConfig()
        auth = api_key_middleware(self._api_keys, self._auth_refused,
                                  RefusalLog(logger, "HTTP request"))
        app = web.Application(client_max_size=max_request_bytes, middlewares=[auth, errors_as_json])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kvwire/transfers", self.transfers)
        app.router.add_post("/v1/completions", self._generation.completions)
        app.router.add_post("/v1/chat/completions", self._generation.chat)
        # vLLM's /tokenize, /detokenize, /version (kvwire.server.tokenize)
        TokenizeHandlers(self._generation, self._model_name, self._max_model_len).add_routes(app)
        return app

    def _auth_refused(self, refusal: Refusal) -> None:
        self._metrics.refused.labels(reason=refusal.value).inc()

    async def health(self, request: web.Request) -> web.Response:
        """200 ``ok`` or 503 with why. Open to probes; the instance's identity (id, role, KV
        endpoints) and the reason are added only for a caller with a valid API key, or when no
        keys are configured: an unauthenticated caller learns no endpoint to attack (decision 125)."""
        keys = self._api_keys
        shown = not keys.enabled or keys.check(request.headers.get("Authorization")) is None
        if self._generation.draining:
            return self._health_response({"status": "shutting down"}, 503, shown)
        status = self._engine_loop.status()
        if status.health is not EngineHealth.OK:
            return self._health_response({"status": status.health.value, "reason": status.reason}, 503, shown)
        dead = self._board.health_body() if self._board is not None else None
        if dead is not None:  # e.g. the heartbeat thread gave up: serving, but not registered
            return self._health_response(dead, 503, shown)
        return self._health_response({"status": "ok"}, 200, shown)

    def _health_response(self, body: dict[str, Any], status: int, shown: bool) -> web.Response:
        if not shown:
            return web.json_response({"status": body.get("status", "unhealthy")}, status=status)
        return web.json_response({**body, **self._identity}, status=status)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self._model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "kvwire",
            "root": self._model_name,
            "parent": None,
            "max_model_len": self._max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def transfers(self, request: web.Request) -> web.Response:
        """The last completed KV transfers of this instance's connector, per side, as
        ``{"send": [[bytes, seconds, busy seconds], ...], "recv": [...], "exposed": [seconds, ...],
        "exposed_to_step": [seconds, ...]}`` (on D, per transfer: P's last layer handed over -> D holds
        every layer, and -> D's engine step has it; exact percentiles for ``kvwire bench serve``;
        oldest first; empty lists on a colocated instance)."""
        del request
        from kvwire.connector.metrics import registered_connector_metrics

        metrics = registered_connector_metrics(self._metrics.registry)
        empty: dict[str, list[Any]] = {"send": [], "recv": [], "exposed": [], "exposed_to_step": []}
        snapshot = metrics.recent.snapshot() if metrics is not None else empty
        return web.json_response(snapshot)
