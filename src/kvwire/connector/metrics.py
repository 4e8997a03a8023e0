"""Prometheus collectors of the P/D connector (exposed by the instance's ``/metrics``).

``side`` is ``send`` (P) or ``recv`` (D). Handover phases: ``p_prefill`` (P: request first seen by
the scheduler -> prompt computed and first token sampled), ``transfer`` (P: end of prefill -> every
layer and the trailer acknowledged by D), ``d_wait`` (D: blocks allocated -> all remote KV in),
``exposed`` (D: P's forward wrote its last layer -> D can decode, from P's wall clock in the trailer).
Per completed transfer and side: ``kvwire_pd_transfer_{seconds,size_bytes,gbps}``, observed by the
worker connector (``KvwireWorkerConnector._observe_transfer``).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_HANDOVER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SIZE_BUCKETS = tuple(float(1 << s) for s in range(16, 36, 2))  # 64 KiB .. 16 GiB
_GBPS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 300.0, 400.0, 1000.0)


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
            "kvwire_pd_handover_seconds",
            "P/D handover time by phase (p_prefill, transfer, d_wait; on D, exposed: P's last layer "
            "handed over -> D holds every layer, exposed_to_step: -> D's engine step has it)",
            ["phase"], buckets=_HANDOVER_BUCKETS_S, registry=registry,
        )
        # One observation per completed transfer and side (TransferTiming: sender from its first
        # layer handed to the plane to the last ack; receiver from the first layer landing to the last).
        self.transfer_seconds = Histogram(
            "kvwire_pd_transfer_seconds", "KV transfer data time per completed transfer",
            ["side"], buckets=_HANDOVER_BUCKETS_S, registry=registry,
        )
        self.transfer_size_bytes = Histogram(
            "kvwire_pd_transfer_size_bytes", "KV payload bytes per completed transfer",
            ["side"], buckets=_SIZE_BUCKETS, registry=registry,
        )
        self.transfer_gbps = Histogram(
            "kvwire_pd_transfer_gbps", "KV transfer throughput per completed transfer (GB/s, 1e9 bytes)",
            ["side"], buckets=_GBPS_BUCKETS, registry=registry,
        )
        self.transfer_busy_gbps = Histogram(
            "kvwire_pd_transfer_busy_gbps",
            "KV transfer throughput over the time the data plane held the transfer's layers (sender)",
            ["side"], buckets=_GBPS_BUCKETS, registry=registry,
        )
        self.recent = RecentTransfers()
        self.blocks_awaiting_send = Gauge(
            "kvwire_pd_blocks_awaiting_send", "P's blocks of finished requests held until the send completes",
            registry=registry,
        )
        self.quarantined_blocks = Gauge(
            "kvwire_pd_quarantined_blocks",
            "D's blocks of failed or aborted receives held back from the engine because a stalled "
            "sender may still write into them (decision 114)",
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
        self.params_refused = Counter(
            "kvwire_pd_kv_params_refused", "kv_transfer_params refused (unsigned, bad_signature, expired, "
            "replayed); the request ran without a transfer", ["reason"], registry=registry,
        )
        self.partial_transfers = Counter(
            "kvwire_pd_partial_transfers",
            "Partial transfers (D holds a prefix, P sends the rest) by side and outcome "
            "(started | missed: D no longer held the prefix and prefilled locally)",
            ["side", "outcome"], registry=registry,
        )


class RecentTransfers:
    """The last ``capacity`` completed transfers per side (bytes, seconds, busy seconds or None):
    exact percentiles for ``kvwire bench serve`` (served at ``/kvwire/transfers``), which histogram
    buckets cannot give. One writer, the worker connector's thread, appends to the deques directly
    (``deque.append`` is atomic); :meth:`snapshot` copies each deque in one step (``deque.copy``), so
    any thread may read while it writes."""

    def __init__(self, capacity: int = 4096) -> None:
        self.rows: dict[str, collections.deque[tuple[int, float, float | None]]] = {
            side: collections.deque(maxlen=capacity) for side in ("send", "recv")
        }
        # D: per transfer, P's forward wrote its last layer -> D holds every layer,
        # and -> D's engine step has the transfer (the wait for D's next step boundary added)
        self.exposed: collections.deque[float] = collections.deque(maxlen=capacity)
        self.exposed_to_step: collections.deque[float] = collections.deque(maxlen=capacity)

    def snapshot(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {side: list(rows.copy()) for side, rows in self.rows.items()}
        out["exposed"] = list(self.exposed.copy())
        out["exposed_to_step"] = list(self.exposed_to_step.copy())
        return out


_lock = threading.Lock()
_by_registry: dict[int, tuple[CollectorRegistry, ConnectorMetrics]] = {}


def registered_connector_metrics(registry: CollectorRegistry) -> ConnectorMetrics | None:
    """The connector's collectors in ``registry`` if a connector created them there, else None."""
    with _lock:
        entry = _by_registry.get(id(registry))
        return entry[1] if entry is not None and entry[0] is registry else None


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
