"""Prometheus collectors of the P/D connector (exposed by the instance's ``/metrics``).

``side`` is ``send`` (P) or ``recv`` (D). Handover phases: ``p_prefill`` (P: request first seen by
the scheduler -> prompt computed and first token sampled), ``transfer`` (P: end of prefill -> every
layer and the trailer acknowledged by D), ``d_wait`` (D: blocks allocated -> all remote KV in).
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_HANDOVER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ConnectorMetrics:
    """One set of collectors per registry (several connectors in one process share it)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfers_started = Counter(
            "kvwire_pd_transfers_started", "KV transfers started", ["side"], registry=registry
        )
        self.transfers_completed = Counter(
            "kvwire_pd_transfers_completed", "KV transfers completed", ["side"], registry=registry
        )
        self.transfers_failed = Counter(
            "kvwire_pd_transfers_failed", "KV transfers failed, by reason", ["side", "reason"],
            registry=registry,
        )
        self.transfer_bytes = Counter(
            "kvwire_pd_transfer_bytes", "KV bytes handed to (send) or received from (recv) the agent",
            ["side"], registry=registry,
        )
        # Counted once per KV layer per transfer: label children resolved here, not per layer.
        self.send_bytes = self.transfer_bytes.labels(side="send")
        self.recv_bytes = self.transfer_bytes.labels(side="recv")
        self.handover_seconds = Histogram(
            "kvwire_pd_handover_seconds", "P/D handover time by phase (p_prefill, transfer, d_wait)",
            ["phase"], buckets=_HANDOVER_BUCKETS_S, registry=registry,
        )
        self.blocks_awaiting_send = Gauge(
            "kvwire_pd_blocks_awaiting_send", "P's blocks of finished requests held until the send completes",
            registry=registry,
        )
        # Read from the agent at scrape time (a function gauge of a monotonic count).
        self.control_rejected = Gauge(
            "kvwire_pd_control_messages_rejected",
            "transfer control messages refused (malformed, unknown, old version, bad MAC, stale epoch)",
            registry=registry,
        )
        self.load_failures = Counter(
            "kvwire_pd_load_failures", "D: remote KV loads that failed, by policy applied (recompute|fail)",
            ["policy"], registry=registry,
        )


_lock = threading.Lock()
_by_registry: dict[int, tuple[CollectorRegistry, ConnectorMetrics]] = {}


def connector_metrics(registry: CollectorRegistry | None = None) -> ConnectorMetrics:
    """The connector's collectors in ``registry`` (default: prometheus_client's global registry),
    created on first use: Prometheus forbids registering the same names twice in one registry."""
    reg = REGISTRY if registry is None else registry
    with _lock:
        entry = _by_registry.get(id(reg))
        if entry is None or entry[0] is not reg:
            entry = (reg, ConnectorMetrics(reg))
            _by_registry[id(reg)] = entry
        return entry[1]
