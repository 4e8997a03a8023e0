"""The KV connectors of an instance: none for role ``both``, the P/D connector for prefill/decode.

Imported lazily so a colocated server needs neither the connector nor the transfer agent. The
connector's Prometheus series go to the server's registry (one ``/metrics`` per instance).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, Metric

from kvwire.engine.config import EngineConfig
from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import Role
from kvwire.server.config import ServerConfig
from kvwire.supervision import HealthBoard
from kvwire.transfer.wire import ControlLimit

if TYPE_CHECKING:
    from kvwire.transfer.core import TransferStats

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ConnectorSet:
    """What the server needs from the connector side. ``enabled`` = requests may carry
    ``kv_transfer_params``."""

    scheduler: Any = None
    worker: Any = None
    kv_endpoints: list[str] = dataclasses.field(default_factory=list)
    enabled: bool = False
    worker_factory: Any = None  # builds rank r's worker half in that rank's process (TP > 1)

    def kv_transports(self) -> dict[str, str]:
        """Peer KV endpoint -> the data plane negotiated with it (empty without a transfer agent)."""
        peer_transports = getattr(getattr(self.worker, "agent", None), "peer_transports", None)
        return dict(peer_transports()) if peer_transports is not None else {}

    def wake_on_transfer_end(self, wake: Callable[[], None]) -> bool:
        """Have the transfer agent call ``wake()`` when a receive ends or a transfer fails (the
        engine loop then steps at once, not at its next poll: decision 153). Nothing without an
        agent in this process. Returns whether the agent will call it."""
        wake_on_completion = getattr(getattr(self.worker, "agent", None), "wake_on_completion", None)
        if wake_on_completion is None:
            return False
        wake_on_completion(wake)
        return True

    def close(self) -> None:
        for half in (self.worker, self.scheduler):
            close = getattr(half, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    logger.exception("closing connector %r failed", half)


# The agent's plain counters exported as ``<name>_total``: (name, help, value from TransferStats).
_AGENT_COUNTERS: tuple[tuple[str, str, Callable[[TransferStats], float]], ...] = (
    # what a plane that copies on the GPU itself (CUDA IPC) moved, the device time it took (their
    # rate is the mover's GB/s) and in how many timed batches
    ("kvwire_kv_device_copy_bytes", "KV bytes copied on the GPU by the data plane (CUDA IPC)",
     lambda s: s.device_copy_bytes),
    ("kvwire_kv_device_copy_seconds", "device time of those copies", lambda s: s.device_copy_ns / 1e9),
    ("kvwire_kv_device_copy_batches", "batches those copies went in (one timed window each)",
     lambda s: s.device_copy_batches),
    # receives granted before the sender's Offer (decision 110): compare with the receives started
    ("kvwire_kv_early_grants", "KV receives granted before the sender's offer", lambda s: s.early_grants),
    ("kvwire_kv_early_grants_unused", "early grants dropped (the offer did not fit, or the sender restarted)",
     lambda s: s.early_grants_unused),
    # D's leases renewed by a live P whose HTTP server or queue still held the request (decision 128)
    ("kvwire_kv_admission_renewals", "KV receive leases renewed by a live sender that had not taken the "
     "request up yet", lambda s: s.admission_renewals),
)


class _AgentStats:
    """The transfer agent's counters, from one snapshot per scrape: ``kvwire_transfer_refused{reason}``
    (control messages that failed the shared secret or were malformed; offers from an agent that is
    not the transfer's bound peer) and the plain counters of ``_AGENT_COUNTERS``."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        stats = self._agent.stats()
        family = CounterMetricFamily("kvwire_transfer_refused", "transfer control messages refused, by "
                                     "reason", labels=["reason"])
        family.add_metric(["unauthenticated_or_malformed"], stats.messages_rejected)
        family.add_metric(["wrong_peer"], stats.offers_refused)
        yield family
        for name, doc, value in _AGENT_COUNTERS:
            yield CounterMetricFamily(name, doc, value=value(stats))
        limits = CounterMetricFamily("kvwire_transfer_limit_hits", "peer messages refused, clamped or "
                                     "forgotten by a transfer control-plane limit", labels=["limit"])
        for limit in ControlLimit:  # every one, 0 before it is hit: alerts can name them
            limits.add_metric([limit.value], stats.limits_hit.get(limit.value, 0))
        yield limits


def build_connector_set(
    config: ServerConfig, engine_config: EngineConfig, registry: Any, *, board: HealthBoard | None = None,
) -> ConnectorSet:
    """Build the connectors for ``config.role`` (raises ConfigError when they are not available).
    The transfer agent starts here with ``config.transfer`` (device, secret and ports included: the
    CLI built it), its supervised threads on ``board`` (the instance's health board);
    ``ConnectorSet.close`` stops it."""
    if config.role is Role.BOTH:
        return ConnectorSet()
    try:
        from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
        from kvwire.connector.factory import RankConnectorFactory, build_connectors
        from kvwire.engine.tp.runner import model_config_of
    except ImportError as exc:
        raise ConfigError(
            f"role {config.role.value}: the P/D connector is not available in this build ({exc})"
        ) from exc
    connector_config = ConnectorConfig(
        role=Role(config.role.value), mode=config.kv_mode, deadline_s=config.kv_deadline_s,
        lease_s=config.kv_deadline_s,
        kv_load_failure_policy=LoadFailurePolicy(config.kv_load_failure_policy.value),
        transfer=config.transfer,  # built by the CLI; passed on as it is
    )
    engine_info = EngineInfo(
        block_size=engine_config.block_size, device=engine_config.device,
        tp_size=engine_config.tensor_parallel_size, num_kv_heads=model_config_of(engine_config).num_kv_heads,
    )
    scheduler, worker = build_connectors(connector_config, engine_info, registry=registry, board=board)
    if engine_info.tp_size == 1 and hasattr(worker, "promise_now") and hasattr(scheduler, "promise_now"):
        scheduler.promise_now = worker.promise_now  # P renews D's lease from admission (decision 123)
        scheduler.withdraw_now = worker.withdraw_now  # ... and ends it when the engine never got it
    agent = getattr(worker, "agent", None)
    if agent is not None and registry is not None:
        registry.register(_AgentStats(agent))
    if registry is not None and agent is not None and hasattr(agent, "peer_transports"):
        from kvwire.connector.transport_metrics import TransportCollector

        registry.register(TransportCollector(agent))
    endpoints = list(scheduler.kv_endpoints)  # rank 0's; the engine adds the other ranks' (TP > 1)
    logger.info("P/D connector (%s, %s) listening on %s", config.role.value, config.kv_mode.value, endpoints)
    return ConnectorSet(scheduler=scheduler, worker=worker, kv_endpoints=endpoints, enabled=True,
                        worker_factory=RankConnectorFactory(connector_config, engine_info))
