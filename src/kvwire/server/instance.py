"""One serving instance's life: engine + engine thread + HTTP app + registration, and their shutdown.

``serve`` is the whole process: start everything, wait for SIGTERM/SIGINT, then within
``shutdown_deadline_s``: refuse new requests (503), deregister from the router, abort in-flight
requests, stop the HTTP listener, stop the engine thread, close connectors. Returns the exit code.
SIGUSR1 drains first (decision 120): deregister and refuse new requests at once, let the requests in
flight finish (for P: their KV sent) within ``drain_timeout_s``, then stop the same way.

The instance owns the process's :class:`~kvwire.supervision.HealthBoard` (``ServerInstance.board``):
every supervised component it builds (the KV transfer agent's threads through the connector
factory, ...) registers there; ``/metrics`` exports it (``kvwire_component_*``) and ``/health`` reads it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from kvwire.engine.config import EngineConfig
from kvwire.errors import EXIT_RANK_LOST, RankLost
from kvwire.http.refusal_log import RefusalLog
from kvwire.protocol.kv_params import endpoints_checked
from kvwire.protocol.kv_signing import KVParamsRefused, verifier_from_secret, verifying
from kvwire.server.app import ServerApp
from kvwire.server.config import ServerConfig
from kvwire.server.connectors import ConnectorSet, build_connector_set
from kvwire.server.engine_loop import EngineLoop, EngineStatus, StatsSnapshot
from kvwire.server.generate import GenerationHandler
from kvwire.server.metrics import ServerMetrics
from kvwire.server.registration import default_instance_id, start_heartbeats
from kvwire.supervision import HealthBoard, SupervisionCollector

logger = logging.getLogger(__name__)


def _build_engine(engine_config: EngineConfig, connectors: ConnectorSet) -> Any:
    from kvwire.engine import LLMEngine

    return LLMEngine(engine_config, scheduler_connector=connectors.scheduler,
                     worker_connector=connectors.worker, worker_connector_factory=connectors.worker_factory)


def _kv_layout(engine: Any, model_name: str) -> Any:
    """What a P/D peer must match (kv_params.KVCacheLayout), advertised and checked per request."""
    from kvwire.protocol.kv_params import KVCacheLayout

    cfg = engine.model.config
    return KVCacheLayout(
        model=model_name, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        block_size=engine.config.block_size, dtype=str(engine.dtype).removeprefix("torch."),
        tp_size=engine.config.tensor_parallel_size,
    )


def _model_vocab_size(engine: Any) -> int | None:
    size = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


class ServerInstance:
    """Owns every resource of the instance; ``start`` then ``stop`` (each once), on one event loop."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig, secret: str | None = None) -> None:
        self.config = config
        self.engine_config = engine_config
        self.instance_id = default_instance_id(config)
        # The instance's one health board (/health, /metrics): its supervised threads (registration,
        # the KV transfer agent's through the connector factory) report there.
        self.board = HealthBoard()
        self._secret = secret
        self._runner: web.AppRunner | None = None
        self._heartbeats: Any = None
        self._connectors: ConnectorSet | None = None
        self._engine: Any = None
        self._engine_loop: EngineLoop | None = None
        self._generation: GenerationHandler | None = None
        self._metrics: ServerMetrics | None = None
        self.url = ""
        self.lost: RankLost | None = None  # the engine lost a tensor-parallel rank: stop, exit non-zero
        self.on_lost: Callable[[RankLost], None] | None = None  # serve() stops the process on it

    async def start(self) -> str:
        """Load the engine, start its thread, listen, register. Returns the base URL."""
        loop = asyncio.get_running_loop()
        metrics = ServerMetrics(self._stats, self._engine_status)
        metrics.registry.register(SupervisionCollector(self.board))
        self._metrics = metrics
        self._connectors = build_connector_set(self.config, self.engine_config, metrics.registry,
                                               board=self.board)
        self._engine = await loop.run_in_executor(None, _build_engine, self.engine_config, self._connectors)
        engine_loop = EngineLoop(self._engine, stall_timeout_s=self.config.engine_stall_timeout_s,
                                 on_lost=self._engine_lost)
        self._engine_loop = engine_loop
        # D steps once its KV is in, and polls slowly meanwhile (decision 158)
        engine_loop.wakes_on_receive = self._connectors.wake_on_transfer_end(engine_loop.wake)
        model_name = self.config.served_model_name or str(self._engine.model_name)
        kv_layout = None
        if self._connectors.enabled:  # every rank's endpoint, once the engine started its ranks
            self._connectors.kv_endpoints = list(self._connectors.scheduler.kv_endpoints)
            kv_layout = _kv_layout(self._engine, model_name)
            self._connectors.scheduler.kv_layout = kv_layout
        max_model_len = int(self._engine.max_model_len)
        self._generation = GenerationHandler(
            engine_loop, self._engine.tokenizer, metrics, model_name, max_model_len,
            accepts_kv_transfer_params=self._connectors.enabled,
            check_kv_transfer_params=self._kv_params_check(metrics),
            withdraw_kv_transfer_params=getattr(self._connectors.scheduler, "withdraw_request_params", None),
            client_write_timeout_s=self.config.client_write_timeout_s,
            vocab_size=_model_vocab_size(self._engine),
            max_waiting_requests=self.config.max_waiting_requests,
            body_timeout_s=self.config.http_body_timeout_s,
        )
        identity = {"instance_id": self.instance_id, "role": self.config.role.value,
                    "kv_endpoints": list(self._connectors.kv_endpoints)}
        app = ServerApp(engine_loop, self._generation, metrics, model_name, max_model_len, identity,
                        board=self.board)
        engine_loop.start(loop)
        self._runner = web.AppRunner(
            app.build(self.config.max_request_bytes, self.config.api_keys), handler_cancellation=True,
            access_log=None,
            shutdown_timeout=max(0.5, self.config.shutdown_deadline_s / 2),
            keepalive_timeout=self.config.http_idle_timeout_s,  # also the deadline of a request's head
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._bound_port()
        self.url = f"http://{self.config.public_host()}:{port}"
        self._heartbeats = start_heartbeats(
            self.config, instance_id=self.instance_id, url=self.url, model=model_name,
            kv_endpoints=self._connectors.kv_endpoints, stats_fn=self._stats,
            secret=self._secret, kv_events=getattr(self._engine, "kv_events", None),
            tokenizer=tokenizer_spec(self._engine.tokenizer, self.engine_config.model), kv_layout=kv_layout,
            transports_fn=self._connectors.kv_transports, board=self.board, max_model_len=max_model_len,
        )
        logger.info("kvwire serve ready: %s (model %s, role %s, max_model_len %d, instance %s)",
                    self.url, model_name, self.config.role.value, max_model_len, self.instance_id)
        return self.url

    def _engine_lost(self, error: RankLost) -> None:
        """Event loop, before the in-flight requests fail: refuse new ones (503 instance_stopping),
        and let the owner stop the instance (deregister, close; decision 085)."""
        logger.error("the engine lost a tensor-parallel rank; this instance stops: %s", error)
        self.lost = error
        if self._generation is not None:
            self._generation.draining = True
        if self.on_lost is not None:
            self.on_lost(error)

    def _kv_params_check(self, metrics: ServerMetrics) -> Callable[[object], object]:
        """The admission check of kv_transfer_params: with a shared secret the router-signature
        check first (refused params are a 403, whatever else is wrong with them), then the
        endpoints' form and the connector's own check (400), before anything is scheduled."""
        assert self._connectors is not None
        check = endpoints_checked(getattr(self._connectors.scheduler, "check_request_params", None))
        verifier = verifier_from_secret(self._secret)
        if verifier is None:
            return check
        logbook = RefusalLog(logger, "kv_transfer_params")

        def refused(exc: KVParamsRefused) -> None:
            metrics.refused.labels(reason=exc.reason).inc()
            logbook.refused(exc.reason, str(exc))

        return verifying(check, verifier, refused)

    def _stats(self) -> StatsSnapshot:
        return self._engine_loop.stats if self._engine_loop is not None else StatsSnapshot()

    def _engine_status(self) -> EngineStatus:
        return self._engine_loop.status() if self._engine_loop is not None else EngineStatus()

    def _bound_port(self) -> int:
        assert self._runner is not None
        for address in self._runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                return int(address[1])
        return self.config.port

    async def drain(self, timeout_s: float) -> bool:
        """Stop taking work and let what is in flight finish: refuse new requests (503
        ``instance_stopping``: a router re-dispatches them), deregister (the router stops routing
        here), then wait until no request is open and no KV awaits sending, at most ``timeout_s``.
        Returns True when drained; :meth:`stop` follows either way. Event loop only."""
        if self._generation is not None:
            self._generation.draining = True
            logger.info("draining %d request(s) in flight", self._generation.open_requests)
        if self._heartbeats is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._heartbeats.close)
        deadline = time.monotonic() + timeout_s
        while not self._idle():
            if time.monotonic() >= deadline:
                logger.warning("drain: requests still in flight after %.1f s; stopping anyway", timeout_s)
                return False
            await asyncio.sleep(0.05)  # a poll with a deadline: the engine thread finishes them
        logger.info("drained: no request in flight")
        return True

    def _idle(self) -> bool:
        """No HTTP request open and (P) no finished request's KV still to send."""
        if self._generation is not None and self._generation.open_requests > 0:
            return False
        registry = self._metrics.registry if self._metrics is not None else None
        awaiting = registry.get_sample_value("kvwire_pd_blocks_awaiting_send") if registry else None
        return not awaiting

    async def stop(self) -> bool:
        """Shut down within the deadline. Returns False if some part had to be abandoned."""
        deadline = time.monotonic() + self.config.shutdown_deadline_s
        loop = asyncio.get_running_loop()
        clean = True
        if self._generation is not None:
            self._generation.draining = True
        if self._heartbeats is not None:
            await loop.run_in_executor(None, self._heartbeats.close)  # deregister first
        if self._engine_loop is not None:
            self._engine_loop.abort_all("the server is shutting down")
        if self._runner is not None:
            try:
                # a cancellation lost here would only let the shutdown go on
                await asyncio.wait_for(  # noqa: TID251
                    self._runner.cleanup(), timeout=max(0.1, deadline - time.monotonic())
                )
            except asyncio.TimeoutError:
                logger.warning("HTTP shutdown did not finish within the deadline")
                clean = False
        if self._engine_loop is not None:
            engine_loop = self._engine_loop
            stopped = await loop.run_in_executor(
                None, engine_loop.close, max(0.1, deadline - time.monotonic()))
            if not stopped:
                logger.warning("engine thread did not stop within the deadline")
                clean = False
        # The engine owns (and closes) its connectors; without an engine, close them here.
        owner = self._engine if self._engine is not None else self._connectors
        if owner is not None and clean:
            await loop.run_in_executor(None, owner.close)
        logger.info("kvwire serve stopped%s", "" if clean else " (deadline passed)")
        return clean


async def serve(config: ServerConfig, engine_config: EngineConfig, secret: str | None = None) -> int:
    """Run an instance until SIGTERM/SIGINT, or until its engine loses a tensor-parallel rank (then
    it shuts down the same way and returns EXIT_RANK_LOST: a supervisor restarts it). Returns the
    process exit code."""
    instance = ServerInstance(config, engine_config, secret)
    stop, drain = asyncio.Event(), asyncio.Event()
    instance.on_lost = lambda _error: stop.set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, drain.set)
    try:
        await instance.start()
        await _first_of(stop.wait(), drain.wait())
        if drain.is_set() and not stop.is_set():  # SIGTERM during the drain cuts it short
            logger.info("SIGUSR1: draining (at most %.1f s)", config.drain_timeout_s)
            await _first_of(instance.drain(config.drain_timeout_s), stop.wait())
        logger.info("%s: shutting down", "rank lost" if instance.lost is not None else "signal received")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        clean = await instance.stop()
    if instance.lost is not None:
        return EXIT_RANK_LOST
    return 0 if clean else 1


async def _first_of(*waits: Coroutine[Any, Any, Any]) -> None:
    """Until the first of ``waits`` completes (the others are cancelled); its exception, if any,
    is raised."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def tokenizer_spec(tokenizer: Any, model: str) -> str:
    """What the router needs to tokenize like this engine (``InstanceInfo.tokenizer``): "byte" for the
    presets' byte tokenizer, else the model directory the tokenizer was loaded from."""
    if type(tokenizer).__name__ == "ByteTokenizer":
        return "byte"
    source = getattr(tokenizer, "source_dir", None)  # a model id's snapshot, or a --tokenizer directory
    return str(source) if source is not None else model
