"""The router's share of vLLM's service API: ``/tokenize``, ``/detokenize``, ``/version`` and the
``/v1/models`` cards (with ``max_model_len``), plus the check of an instance's configured KV mode.

``/tokenize`` and ``/detokenize`` are forwarded to one live instance serving the body's ``model``
(any role; turns rotate): the instances tokenize exactly as they serve (chat templates included).
Answers and instance errors pass through unchanged; no live instance -> 503, unknown model -> 404,
an instance that cannot be reached -> 502, in vLLM's error body shape. See docs/decisions/122.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import msgspec
from aiohttp import web

from kvwire import __version__
from kvwire.discovery.heartbeats import InstanceInfo
from kvwire.protocol.kv_params import Role, TransferMode
from kvwire.router.registry import InstanceView, Registry
from kvwire.router.relay import Upstream, UpstreamFailure

log = logging.getLogger(__name__)

_ROLES = (Role.BOTH, Role.DECODE, Role.PREFILL)  # the first with a live instance answers


def error_response(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    """An error in the body shape both OpenAI clients and vLLM's use (``code``: the HTTP status)."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.json_response(body, status=status)


class VllmApi:
    """Handlers on the router's event loop. ``upstream`` is read when a request arrives (the router
    creates it in ``start()``)."""

    def __init__(
        self, registry: Registry, upstream: Callable[[], Upstream | None],
        headers: Callable[[web.Request], dict[str, str]],
        read_body: Callable[[web.Request], Awaitable[bytes | web.Response]],
    ) -> None:
        self._registry = registry
        self._upstream = upstream
        self._headers = headers  # the headers an instance gets for a client's request
        self._read_body = read_body  # the router's: size and deadline bounded (413 / 408 responses)
        self._turn = itertools.count()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/tokenize")

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/detokenize")

    async def version(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"version": __version__})

    async def _forward(self, request: web.Request, path: str) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            decoded = msgspec.json.decode(body) if body.strip() else None
        except msgspec.DecodeError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
        except RecursionError:  # msgspec's nesting guard
            return error_response(400, "request body nests JSON arrays/objects too deeply", "BadRequestError")
        if not isinstance(decoded, dict):
            return error_response(400, "request body must be a JSON object", "BadRequestError")
        model = decoded.get("model") if isinstance(decoded.get("model"), str) else None
        inst = self._pick(model)
        if isinstance(inst, web.Response):
            return inst
        upstream: Upstream | None = self._upstream()
        if upstream is None:
            return error_response(503, "the router is starting", "ServiceUnavailableError")
        try:
            resp, data = await upstream.read_all(inst, inst.role.value, path, body, self._headers(request))
        except UpstreamFailure as exc:
            if exc.body:
                return web.Response(body=exc.body, status=exc.status,
                                    headers={"Content-Type": exc.content_type})
            return error_response(exc.status, str(exc), "BadGatewayError")
        ctype = resp.headers.get("Content-Type", "application/json")
        return web.Response(body=data, status=resp.status, headers={"Content-Type": ctype})

    def _pick(self, model: str | None) -> InstanceView | web.Response:
        for role in _ROLES:
            live = self._registry.live(role, model)
            if live:
                return live[next(self._turn) % len(live)]
        known = {v.info.model for v in self._registry.snapshot()}
        if model is not None and known and model not in known:
            return error_response(404, f"The model `{model}` does not exist; served: {sorted(known)}",
                                  "NotFoundError", "model")
        return error_response(503, "no live instance" + (f" for model {model!r}" if model else ""),
                              "ServiceUnavailableError")


def model_cards(views: tuple[InstanceView, ...], servable: Collection[str] | None = None) -> dict[str, Any]:
    """``/v1/models`` in vLLM's shape; ``max_model_len``: the smallest any live instance of the model
    announced (None when none did). ``servable``: list only these models (decision 124)."""
    lengths: dict[str, list[int]] = {}
    for v in views:
        if v.alive and (servable is None or v.info.model in servable):
            lengths.setdefault(v.info.model, [])
            if v.info.max_model_len > 0:
                lengths[v.info.model].append(v.info.max_model_len)
    data: list[dict[str, Any]] = [
        {"id": m, "object": "model", "created": 0, "owned_by": "kvwire", "root": m, "parent": None,
         "max_model_len": min(lens) if lens else None, "permission": []}
        for m, lens in sorted(lengths.items())
    ]
    return {"object": "list", "data": data}


def mode_overridden(info: InstanceInfo, router_mode: TransferMode) -> bool:
    """True when the instance was configured with a KV transfer mode other than the router's (the
    router's per-request mode wins)."""
    return info.role is not Role.BOTH and info.kv_mode not in ("", router_mode.value)


def warn_if_overridden(info: InstanceInfo, router_mode: TransferMode) -> None:
    """Registry callback (listener thread), once per registration (new instance or epoch)."""
    if mode_overridden(info, router_mode):
        log.warning("instance %s (%s) is configured for %s mode, but this router runs %s mode: its "
                    "requests use %s (set the instance's mode / send_type to match, or run the router "
                    "with --mode %s)", info.instance_id, info.role.value, info.kv_mode, router_mode.value,
                    router_mode.value, info.kv_mode)
