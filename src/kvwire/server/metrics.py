"""Prometheus metrics of one server instance, in a registry owned by the app (no globals).

Request-level series (counters, TTFT/ITL histograms) are updated by the HTTP handlers on the event
loop thread (TTFT/ITL/E2E through :class:`kvwire.server.generate.RequestTimer`). Engine-level series
(queues, KV blocks, preemptions, stalls) are read at scrape time from the engine loop's latest
:class:`StatsSnapshot` and :class:`EngineStatus`. Other components register their series in
:attr:`ServerMetrics.registry` (the KV connector does so when it is built) or pass a collector to
:meth:`ServerMetrics.add_collector`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwire.server.engine_loop import EngineHealth, EngineStatus, StatsSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. TTFT spans a queued prefill on CPU (long tail); ITL is one decode step.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Collector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


class _EngineStatsCollector:
    """Gauges/counters read from the engine loop's snapshot at scrape time."""

    def __init__(self, stats_fn: Callable[[], StatsSnapshot]) -> None:
        self._stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        gauges = {
            "kvwire_num_requests_running": ("requests being computed", stats.num_running),
            "kvwire_num_requests_waiting": ("requests waiting to be scheduled", stats.num_waiting),
            "kvwire_num_requests_waiting_for_remote_kv": (
                "requests waiting for KV from a prefill instance", stats.num_waiting_for_remote_kv),
            "kvwire_kv_blocks_in_use": ("KV cache blocks allocated (incl. those awaiting a send)",
                                        stats.kv_blocks_in_use),
            "kvwire_kv_blocks_total": ("KV cache blocks in the pool", stats.kv_blocks_total),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("kvwire_num_preemptions", "requests preempted (recompute)",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("kvwire_prefix_cache_hit_tokens", "prompt tokens found in the local "
                                  "prefix cache (not computed, not received)",
                                  value=stats.num_prefix_cache_hit_tokens)
        yield GaugeMetricFamily("kvwire_engine_stats_age_seconds", "age of the engine statistics above "
                                "(copied between engine steps; live metrics may be newer)",
                                value=stats.age_s())


class _EngineStatusCollector:
    """Engine health read from the engine loop at scrape time."""

    def __init__(self, status_fn: Callable[[], EngineStatus]) -> None:
        self._status_fn = status_fn

    def collect(self) -> Iterator[Metric]:
        status = self._status_fn()
        yield GaugeMetricFamily("kvwire_engine_stalled", "1 while the engine makes no progress with "
                                "requests in flight (see --engine-stall-timeout-s), else 0",
                                value=int(status.health is EngineHealth.STALLED))
        yield CounterMetricFamily("kvwire_engine_stalls", "engine stalls declared (each failed the "
                                  "requests in flight with 503)", value=status.num_stalls)


class ServerMetrics:
    """Every series of one instance. Event-loop thread for updates; scrape from anywhere."""

    def __init__(
        self, stats_fn: Callable[[], StatsSnapshot], status_fn: Callable[[], EngineStatus] = EngineStatus
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "kvwire_requests", "finished requests by endpoint and outcome "
            "(stop, length, abort, error, invalid, forbidden, shutdown, stalled, disconnect, client_timeout)",
            ["endpoint", "outcome"], registry=reg)
        self.prompt_tokens = Counter("kvwire_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=reg)
        self.generation_tokens = Counter("kvwire_generation_tokens", "generated tokens sent to clients",
                                         registry=reg)
        self.ttft = Histogram("kvwire_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("kvwire_inter_token_latency_seconds", "time between generated tokens",
                             buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("kvwire_e2e_request_latency_seconds", "arrival to last token",
                             buckets=_E2E_BUCKETS, registry=reg)
        self.refused = Counter(
            "kvwire_refused", "requests refused before admission: missing/wrong API key (401), "
            "kv_transfer_params unsigned, tampered, expired or replayed (403)", ["reason"], registry=reg)
        reg.register(_EngineStatsCollector(stats_fn))
        reg.register(_EngineStatusCollector(status_fn))

    def add_collector(self, collector: Collector) -> None:
        """Let another component (e.g. the KV connector) expose its series on this ``/metrics``."""
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
