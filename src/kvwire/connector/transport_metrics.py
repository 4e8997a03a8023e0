"""Prometheus view of the transfer agent's data planes: which plane each peer uses (read at scrape
time from :meth:`kvwire.transfer.TransferAgent.peer_transports`; no per-transfer cost)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class _Agent(Protocol):
    @property
    def transports(self) -> list[str]: ...

    def peer_transports(self) -> dict[str, str]: ...


class TransportCollector(Collector):
    """``kvwire_kv_peers{transport}``: peer agents whose negotiated data plane is ``transport``
    (``none``: the pair has none, e.g. a forced transport it cannot use);
    ``kvwire_kv_transport_held{transport}``: 1 for each plane this agent holds."""

    def __init__(self, agent: _Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        peers = GaugeMetricFamily(
            "kvwire_kv_peers", "peer agents by negotiated KV data plane", labels=["transport"]
        )
        for transport, count in sorted(Counter(self._agent.peer_transports().values()).items()):
            peers.add_metric([transport], count)
        yield peers
        held = GaugeMetricFamily(
            "kvwire_kv_transport_held", "KV data planes this agent holds", labels=["transport"]
        )
        for transport in self._agent.transports:
            held.add_metric([transport], 1)
        yield held
