"""Router Prometheus metrics (one ``CollectorRegistry`` per app, no globals).

TTFT and ITL are measured at the router, as the client sees them: TTFT from the moment the request
arrived to the first forwarded SSE event that carries generated text; ITL between such events
(:class:`kvwire.router.relay.SSETokenMeter` finds those events).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvwire.protocol.kv_params import Role
from kvwire.router.registry import InstanceState, Registry

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0,
)
_ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvwire_router_requests", "Requests finished, by endpoint and outcome", ["endpoint", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvwire_router_ttft_seconds", "Time to first generated token (streaming), at the router",
            ["mode"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.itl = Histogram(
            "kvwire_router_itl_seconds", "Gap between generated-token SSE events, at the router",
            ["mode"], buckets=_ITL_BUCKETS_S, registry=r,
        )
        self.e2e = Histogram(
            "kvwire_router_request_seconds", "Whole request latency at the router", ["stream"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )
        self.upstream_errors = Counter(
            "kvwire_router_upstream_errors", "Upstream failures by instance role and kind", ["role", "kind"],
            registry=r,
        )
        self.migrations = Counter(
            "kvwire_router_migrations",
            "Requests moved to another instance after one died: before the first byte "
            "(kind=redispatch) or mid-stream (kind=stream)", ["kind"], registry=r,
        )
        self.retries = Counter(
            "kvwire_router_retries", "Dispatches retried after a refused connection", registry=r
        )
        self.auth_refused = Counter(
            "kvwire_router_auth_refused", "Client requests refused for a missing or wrong API key (401)",
            ["reason"], registry=r,
        )
        self.upstream_connection_waits = Counter(
            "kvwire_router_upstream_connection_waits", "Upstream requests that waited for a connection "
            "(--upstream-max-connections or --upstream-max-connections-per-instance reached)", registry=r,
        )
        self.inflight = Gauge("kvwire_router_inflight_requests", "Client requests in progress", registry=r)
        # KV-aware routing (policy kv_aware): prompt tokens routed, and those the chosen instance held
        self.kv_prompt_tokens = Counter(
            "kvwire_router_kv_prompt_tokens", "Prompt tokens routed by KV-aware picks, by role", ["role"],
            registry=r,
        )
        self.kv_hit_tokens = Counter(
            "kvwire_router_kv_hit_tokens", "Prompt tokens the KV-aware pick held cached (KV index), by role",
            ["role"], registry=r,
        )
        self.partial_transfers = Counter(
            "kvwire_router_partial_transfers", "P/D requests where P sends only the blocks D lacks",
            registry=r,
        )
        self.skipped_prefills = Counter(
            "kvwire_router_skipped_prefills", "P/D requests sent to D alone (it held nearly all the prompt)",
            registry=r,
        )
        self.pd_fallback = Counter(
            "kvwire_router_pd_fallback", "Requests served by a decode instance alone, as colocated requests, "
            "because no prefill instance of the model was live (--pd-fallback colocated)", registry=r,
        )
        self.client_kv_params = Counter(
            "kvwire_router_client_kv_params_dropped", "Client requests that carried kv_transfer_params, "
            "removed before dispatch (only the router sets them)", registry=r,
        )
        # Streaming push: the client's stream opened with P's first token (decision 121)
        self.first_tokens_from_prefill = Counter(
            "kvwire_router_first_tokens_from_prefill", "P/D streams whose first token came from P's answer",
            registry=r,
        )

    def add_discovery(self, registry: Registry, received: Callable[[], dict[str, int]],
                      dropped: Callable[[], dict[str, int]], stale: Callable[[], bool] = bool,
                      connections_dropped: Callable[[], int] = int,
                      freshness_evicted: Callable[[], int] = int) -> None:
        self.registry.register(_DiscoveryCollector(registry, received, dropped, stale, connections_dropped,
                                                   freshness_evicted))


class _DiscoveryCollector(Collector):
    """Instances by role and state, discovery messages by result, read at scrape time."""

    def __init__(self, registry: Registry, received: Callable[[], dict[str, int]],
                 dropped: Callable[[], dict[str, int]], stale: Callable[[], bool],
                 connections_dropped: Callable[[], int], freshness_evicted: Callable[[], int]) -> None:
        self._registry = registry
        self._freshness_evicted = freshness_evicted
        self._received = received
        self._dropped = dropped
        self._stale = stale
        self._connections_dropped = connections_dropped

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield self._instances()
        recv = CounterMetricFamily(
            "kvwire_router_discovery_messages", "Discovery messages applied, by result", labels=["result"]
        )
        for result, n in sorted(self._received().items()):
            recv.add_metric([result], n)
        yield recv
        drop = CounterMetricFamily(
            "kvwire_router_discovery_dropped",
            "Discovery messages dropped (malformed, unauthenticated)",
            labels=["reason"],
        )
        for reason, n in sorted(self._dropped().items()):
            drop.add_metric([reason], n)
        yield drop
        yield CounterMetricFamily(
            "kvwire_router_discovery_connections_dropped",
            "Discovery connections closed before one valid message (ZeroMQ drops the connection of a "
            "frame over 64 KiB; also port scans and peers whose messages were all refused)",
            value=self._connections_dropped(),
        )
        yield CounterMetricFamily(
            "kvwire_router_discovery_ttl_clamped",
            "Heartbeats whose promised ttl_s was negative, NaN or over --max-record-ttl-s (clamped)",
            value=self._registry.ttl_clamped,
        )
        yield CounterMetricFamily(
            "kvwire_router_discovery_freshness_evicted",
            "Instance epochs whose last seq the router forgot early: it remembered 10 x --max-instances "
            "(a replay of one is then refused only by the time window)",
            value=self._freshness_evicted(),
        )
        yield GaugeMetricFamily(
            "kvwire_router_discovery_stale",
            "1 while the instance view is not backed by live discovery (etcd unreachable)",
            value=1.0 if self._stale() else 0.0,
        )

    def _instances(self) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(
            "kvwire_router_instances", "Known instances by role and state", labels=["role", "state"]
        )
        counts = {(role, state): 0 for role in Role for state in InstanceState}
        for view in self._registry.snapshot():
            counts[(view.role, view.state)] += 1
        for (role, state), n in counts.items():
            gauge.add_metric([role.value, state.value], n)
        return gauge
