"""Build the connector pair of one engine (built-in engine: one process, one worker rank)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.metrics import connector_metrics
from kvwire.connector.scheduler import KvwireSchedulerConnector
from kvwire.connector.worker import AgentLike, KvwireWorkerConnector
from kvwire.supervision import HealthBoard
from kvwire.transfer import TransferAgent, TransferConfig


def transfer_config_for(config: ConnectorConfig, engine_info: EngineInfo) -> TransferConfig:
    """The agent's config: ``config.transfer`` or defaults on loopback for the engine's device,
    with the connector's deadline as the agent's default deadline."""
    if config.transfer is not None:
        return config.transfer
    return TransferConfig(device=engine_info.device, default_deadline_s=config.agent_deadline_s)


def build_connectors(
    config: ConnectorConfig,
    engine_info: EngineInfo,
    *,
    agent: AgentLike | None = None,
    registry: CollectorRegistry | None = None,
    board: HealthBoard | None = None,
) -> tuple[KvwireSchedulerConnector, KvwireWorkerConnector]:
    """Start a transfer agent (unless one is given) and return (scheduler half, worker half).

    The worker half owns the agent: ``worker.close()`` stops it. ``scheduler.kv_endpoints`` is what
    the instance advertises to the router (``InstanceInfo.kv_endpoints``); ``scheduler.instance_id``
    is the agent's epoch. Metrics go to ``registry`` (default: prometheus_client's global one). The
    agent's supervised threads go on ``board`` (the process's health board; None: a private one).
    """
    owns_agent = agent is None
    if agent is None:
        agent = TransferAgent(transfer_config_for(config, engine_info), board=board)
    metrics = connector_metrics(registry)
    worker = KvwireWorkerConnector(config, engine_info, agent, metrics=metrics, owns_agent=owns_agent)
    scheduler = KvwireSchedulerConnector(
        config, engine_info, [agent.endpoint], instance_id=agent.instance_id, metrics=metrics
    )
    return scheduler, worker


def with_rank(engine_info: EngineInfo, rank: int) -> EngineInfo:
    """The same engine info for another worker rank (hosts with several workers: one agent each)."""
    return dataclasses.replace(engine_info, rank=rank)


@dataclasses.dataclass(frozen=True)
class RankConnectorFactory:
    """Builds tensor-parallel rank ``r``'s worker half, with its own transfer agent, in that rank's
    process (picklable; the built-in engine's ``worker_connector_factory``). Fixed ports (bound and
    advertised) become ``port + r``; ``cuda:N`` becomes ``cuda:N+r``. Its metrics stay in that process."""

    config: ConnectorConfig
    engine_info: EngineInfo

    def __call__(self, rank: int) -> KvwireWorkerConnector:
        info = with_rank(self.engine_info, rank)
        if info.device.startswith("cuda"):
            base = int(info.device.split(":", 1)[1]) if ":" in info.device else 0
            info = dataclasses.replace(info, device=f"cuda:{base + rank}")
        agent = TransferAgent(transfer_config_for(self.config, info).for_rank(rank, info.device))
        metrics = connector_metrics(CollectorRegistry())
        return KvwireWorkerConnector(self.config, info, agent, metrics=metrics, owns_agent=True)
