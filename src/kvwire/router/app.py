"""The router's aiohttp application: OpenAI endpoints, /v1/models, /health, /metrics, /instances.

:class:`RouterServer` owns everything a running router needs (registry, discovery listener, sweeper,
upstream session, HTTP site) and stops all of it in :meth:`RouterServer.stop`. Errors are converted
to HTTP here, once: invalid input -> 400, unknown model -> 404, body too large -> 413, no live
instance -> 503, upstream 4xx/5xx -> the same status and body. A client disconnect cancels the
handler (``handler_cancellation``), which cancels the upstream calls; so does a client that stops
reading (streaming or not), once a write to it passes ``client_write_timeout_s`` (outcome
``client_timeout``). The credentials the router sends to instances (:func:`instance_headers`) are
at the end.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvwire.errors import InvalidRequestError, NoInstanceError
from kvwire.http.front_door import Refusal, RefusalLog, api_key_middleware, bearer_header, client_gone
from kvwire.router.config import PdFallback, RouterConfig
from kvwire.router.discovery_backend import ZmqDiscovery, make_discovery
from kvwire.router.dispatcher import Dispatcher
from kvwire.router.listener import DiscoveryListener
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import InstanceView, KvIndex, Registry
from kvwire.router.relay import Upstream, UpstreamFailure, UpstreamLimits
from kvwire.router.request import ClientRequest, Outcome, parse_client_request
from kvwire.router.selection import ModelNotFoundError, Selector
from kvwire.router.vllm_api import VllmApi, mode_overridden, model_cards, warn_if_overridden
from kvwire.supervision import HealthBoard, SupervisionCollector

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # how long stop() lets requests in flight finish before cancelling them
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def error_response(status: int, message: str, type_: str) -> web.Response:
    """OpenAI's error body as vLLM writes it: ``param`` present, ``code`` the HTTP status."""
    return web.json_response({"error": {"message": message, "type": type_, "param": None, "code": status}},
                             status=status)


class RouterServer:
    """Start with ``await server.start()``; ``server.port`` / ``server.discovery_port`` are then bound."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        # The router's one health board: its supervised threads and tasks (/health, /metrics)
        self.board = HealthBoard()
        self.metrics.registry.register(SupervisionCollector(self.board))
        self.kv_index = KvIndex(cfg.kv_index_max_blocks)
        self.registry = Registry(cfg.instance_ttl_s, cfg.forget_after_s, on_remove=self._forget_instance,
                                 on_register=lambda info: warn_if_overridden(info, cfg.mode),
                                 max_instances=cfg.max_instances, max_record_ttl_s=cfg.max_record_ttl_s)
        # ZeroMQ heartbeats (default, with KV events into the index) or an etcd watch
        self.discovery = make_discovery(cfg, self.registry, self.kv_index, board=self.board)
        self.selector = Selector(self.registry, cfg.policy, cfg.seed, kv_index=self.kv_index,
                                 decode_alone=cfg.pd_fallback is PdFallback.COLOCATED)
        self.metrics.add_discovery(
            self.registry, lambda: dict(self.discovery.received), lambda: dict(self.discovery.dropped),
            lambda: self.discovery.stale, lambda: self.discovery.connections_dropped,
            lambda: self.discovery.freshness_evicted,
        )
        refusals = RefusalLog(log, "client request")
        middlewares = [api_key_middleware(cfg.api_keys, self._auth_refused, refusals)]
        self.app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=middlewares)
        self.app.router.add_post(COMPLETIONS, self._completions)
        self.app.router.add_post(CHAT, self._chat)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics_handler)
        self.app.router.add_get("/instances", self._instances)
        # vLLM's /tokenize, /detokenize (forwarded to an instance) and /version (kvwire.router.vllm_api)
        VllmApi(self.registry, lambda: self._upstream, self._instance_headers,
                self._read_body_or_error).add_routes(self.app)
        self._runner: web.AppRunner | None = None
        self._upstream: Upstream | None = None
        self._dispatcher: Dispatcher | None = None
        self._site: web.SockSite | None = None
        self._active: set[asyncio.Task[Any]] = set()  # handlers in flight (cancelled on stop)
        self.port = 0

    @property
    def discovery_address(self) -> str:
        return self.discovery.address

    @property
    def listener(self) -> DiscoveryListener:
        """The ZeroMQ heartbeat listener (embedded discovery only)."""
        assert isinstance(self.discovery, ZmqDiscovery), "the router watches etcd"
        return self.discovery.listener

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        await self.discovery.start()
        self._upstream = Upstream(
            self.registry, self.metrics, self.cfg.connect_timeout_s, self.cfg.upstream_timeout_s,
            limits=UpstreamLimits(self.cfg.upstream_max_connections,
                                  self.cfg.upstream_max_connections_per_instance),
        )
        self._dispatcher = Dispatcher(self.cfg, self.selector, self._upstream, self.metrics)
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
            keepalive_timeout=self.cfg.http_idle_timeout_s,  # also the deadline of a request's head
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        self.port = sock.getsockname()[1]
        self._site = web.SockSite(self._runner, sock, backlog=1024)
        await self._site.start()
        log.info("router on %s, discovery on %s, policy %s, mode %s", self.url, self.discovery_address,
                 self.cfg.policy.value, self.cfg.mode.value)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop listening, give requests in flight ``grace_s`` to finish, cancel the rest (which closes
        their upstream connections, so the instances abort them), then stop every thread."""
        if self._site is not None:
            await self._site.stop()
        if self._active:
            await asyncio.wait(set(self._active), timeout=grace_s)
            for task in set(self._active):
                task.cancel()
            if self._active:
                await asyncio.wait(set(self._active), timeout=5.0)
        if self._dispatcher is not None:
            await self._dispatcher.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._upstream is not None:
            await self._upstream.close()
        await self.discovery.stop()

    # --- OpenAI endpoints -----------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        assert self._dispatcher is not None, "start() first"
        t0 = time.perf_counter()
        outcome, stream = Outcome.ERROR, False
        creq: ClientRequest | None = None
        self.metrics.inflight.inc()
        task = asyncio.current_task()
        if task is not None:
            self._active.add(task)
        try:
            creq = parse_client_request(path, await self._read_body(request), request.headers)
            creq.t0, stream = t0, creq.stream
            if creq.client_kv_params:
                self.metrics.client_kv_params.inc()
            creq.headers = instance_headers(creq.headers, self.cfg)
            response = await self._dispatcher.dispatch(request, creq)
            outcome = creq.outcome
            return response
        except UpstreamFailure as exc:
            outcome = Outcome.UPSTREAM_ERROR
            return _upstream_error_response(exc)
        except _CLIENT_ERRORS as exc:
            status, outcome, type_ = _client_error(exc)
            return error_response(status, str(exc), type_)
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            timed_out = creq is not None and creq.outcome is Outcome.CLIENT_TIMEOUT  # stopped reading
            outcome = Outcome.CLIENT_TIMEOUT if timed_out else Outcome.CLIENT_DISCONNECTED
            if isinstance(exc, ConnectionResetError):  # a routine event, not an error to log
                return client_gone(request, exc)
            raise
        finally:
            self._active.discard(task)
            self.metrics.inflight.dec()
            self.metrics.requests.labels(endpoint=path, outcome=outcome.value).inc()
            if outcome is Outcome.OK:
                label = "true" if stream else "false"
                self.metrics.e2e.labels(stream=label).observe(time.perf_counter() - t0)

    async def _read_body_or_error(self, request: web.Request) -> bytes | web.Response:
        """The body within ``--max-body-bytes`` and ``--http-body-timeout-s``, or its 413 / 408."""
        try:
            return await self._read_body(request)
        except (_BodyTooLarge, _BodyTimeout) as exc:
            status, _, type_ = _client_error(exc)
            return error_response(status, str(exc), type_)

    async def _read_body(self, request: web.Request) -> bytes:
        """The body within ``--max-body-bytes`` and ``--http-body-timeout-s``. The handler's
        cancellation (the client went away) always propagates, also when the body's last bytes arrive
        in the same loop iteration: not ``asyncio.wait_for``, which before Python 3.12 returns the
        body then (CPython gh-86296) and the request would go to P and D for nobody (decision 146)."""
        limit, timeout_s = self.cfg.max_body_bytes, self.cfg.http_body_timeout_s
        if request.content_length is not None and request.content_length > limit:
            size = request.content_length
            raise _BodyTooLarge(f"request body of {size} bytes exceeds the {limit}-byte limit")
        read = asyncio.ensure_future(request.read())
        try:
            done, _ = await asyncio.wait({read}, timeout=timeout_s)
        finally:
            if not read.done():
                read.cancel()  # timed out, or the client went away
            elif not read.cancelled():
                read.exception()  # retrieved (raised below unless the client went away)
        if not done:
            raise _BodyTimeout(f"request body did not arrive within {timeout_s:g} s (--http-body-timeout-s)")
        try:
            return read.result()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _BodyTooLarge(f"request body exceeds the {limit}-byte limit") from exc

    def _auth_refused(self, refusal: Refusal) -> None:
        self.metrics.auth_refused.labels(reason=refusal.value).inc()

    # --- service endpoints ----------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        # only the models a request could be served on now (decision 124)
        return web.json_response(model_cards(self.registry.snapshot(), self.selector.servable_models()))

    def _instance_headers(self, request: web.Request) -> dict[str, str]:
        auth = request.headers.get("Authorization")
        forwarded = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
        return instance_headers(forwarded, self.cfg)

    async def _health(self, request: web.Request) -> web.Response:
        """200 ``ok``; 503 naming the dead component when a supervised thread or task gave up."""
        live = sum(1 for v in self.registry.snapshot() if v.alive)
        discovery = {"backend": self.discovery.kind.value, "stale": self.discovery.stale,
                     "error": self.discovery.last_error}
        body: dict[str, Any] = {"status": "ok", "live_instances": live, "discovery": discovery}
        dead = self.board.health_body()
        if dead is not None:
            return web.json_response({**body, **dead}, status=503)
        return web.json_response(body)

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _instances(self, request: web.Request) -> web.Response:
        """Every registry entry. With API keys configured and ``/instances`` opened to everyone
        (``--open-endpoint instances``), a caller without a valid key gets no addresses (URL, KV
        endpoints, data-plane peers): nothing to aim an attack at (decision 125)."""
        stale = self.discovery.stale
        keys = self.cfg.api_keys
        hide = keys.enabled and keys.check(request.headers.get("Authorization")) is not None
        entries = [self._instance_json(v, stale) for v in self.registry.snapshot()]
        if hide:
            for entry in entries:
                entry["url"], entry["kv_endpoints"] = None, []
                if entry["load"] is not None:
                    entry["load"]["kv_transports"] = {}
        return web.json_response(entries)

    def _instance_json(self, v: InstanceView, stale: bool) -> dict[str, Any]:
        load = v.load
        requests, tokens = self.selector.inflight(v.instance_id)
        return {
            "id": v.instance_id,
            "epoch": v.info.epoch,
            "role": v.role.value,
            "url": v.url,
            "model": v.info.model,
            "kv_endpoints": list(v.info.kv_endpoints),
            "kv_layout": None if v.info.kv_layout is None else msgspec.to_builtins(v.info.kv_layout),
            "version": v.info.version,
            "max_model_len": v.info.max_model_len or None,
            # the mode the instance was configured with ("" = none); overridden: the router's differs
            "kv_mode": v.info.kv_mode or None,
            "kv_mode_overridden": mode_overridden(v.info, self.cfg.mode),
            "alive": v.alive,
            "state": v.state.value,
            "reason": v.reason,
            # True while etcd is unreachable: this entry is the router's last view, not a live one.
            "discovery_stale": stale,
            "last_seen_s": round(self.registry.age_s(v), 3),
            "load": None if load is None else {
                "num_running": load.num_running,
                "num_waiting": load.num_waiting,
                "free_kv_blocks": load.free_kv_blocks,
                "total_kv_blocks": load.total_kv_blocks,
                "kv_transports": dict(load.kv_transports),
            },
            "router_inflight": {"requests": requests, "tokens": tokens},
            "kv_cache": {
                "cached_blocks": self.kv_index.num_blocks(v.instance_id),  # in the router's KV index
                "block_size": self.kv_index.block_size(v.instance_id),
                "hit_rate": self.selector.hit_rate(v.instance_id),  # cached share of prompts routed there
            },
        }

    def _forget_instance(self, instance_id: str) -> None:
        """Registry callback (listener or sweeper thread): the instance left; drop its KV entries."""
        self.selector.forget(instance_id)


class _BodyTooLarge(InvalidRequestError):
    pass


class _BodyTimeout(InvalidRequestError):
    pass


# Errors raised before anything went upstream -> (HTTP status, outcome label, OpenAI error type).
# First match wins: subclasses before their bases.
_ERROR_TABLE: tuple[tuple[type[Exception], int, Outcome, str], ...] = (
    (_BodyTooLarge, 413, Outcome.TOO_LARGE, "invalid_request_error"),
    (_BodyTimeout, 408, Outcome.BODY_TIMEOUT, "invalid_request_error"),
    (InvalidRequestError, 400, Outcome.INVALID, "invalid_request_error"),
    (ModelNotFoundError, 404, Outcome.MODEL_NOT_FOUND, "not_found_error"),
    (NoInstanceError, 503, Outcome.NO_INSTANCE, "service_unavailable"),
)
_CLIENT_ERRORS = tuple(row[0] for row in _ERROR_TABLE)


def _client_error(exc: Exception) -> tuple[int, Outcome, str]:
    for cls, status, outcome, type_ in _ERROR_TABLE:
        if isinstance(exc, cls):
            return status, outcome, type_
    raise AssertionError(f"{type(exc).__name__} is not in _ERROR_TABLE")


def _upstream_error_response(exc: UpstreamFailure) -> web.Response:
    if exc.body:
        # The instance's own error, status and body unchanged (and its Retry-After: a full queue's 429).
        headers = {"Content-Type": exc.content_type}
        if exc.retry_after:
            headers["Retry-After"] = exc.retry_after
        return web.Response(body=exc.body, status=exc.status, headers=headers)
    return error_response(exc.status, str(exc), "upstream_error")


# --- credentials sent to instances ---------------------------------------------------------------
# Clients authenticate to the router with its own keys (:mod:`kvwire.http.front_door`); instances are
# a separate trust boundary. The router sends ``RouterConfig.instance_api_key`` to every instance.
# Without one, it passes the client's ``Authorization`` header on only when it has no keys of its own
# (a router in front of instances that check keys themselves, e.g. vLLM's ``--api-key``); a client's
# key for the router is never shown to instances.


def instance_headers(forwarded: dict[str, str], cfg: RouterConfig) -> dict[str, str]:
    """``forwarded`` (the client's headers the router passes on) with the instance credentials."""
    headers = {k: v for k, v in forwarded.items() if k.lower() != "authorization"}
    if cfg.instance_api_key:
        headers.update(bearer_header(cfg.instance_api_key))
    elif not cfg.api_keys.enabled and "Authorization" in forwarded:
        headers["Authorization"] = forwarded["Authorization"]
    return headers
