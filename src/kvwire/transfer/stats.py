"""Counters of one transfer agent (read with ``agent.stats()``; exported to Prometheus elsewhere)."""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections import Counter

from kvwire.transfer.enums import FailReason


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """A consistent snapshot of an agent's counters (monotonic since the agent started)."""

    sends_started: int = 0
    sends_completed: int = 0
    recvs_started: int = 0
    recvs_completed: int = 0
    failed: dict[str, int] = dataclasses.field(default_factory=dict)  # FailReason value | "other" -> count
    # control-plane limits hit (decision 116), by ControlLimit value: refused, clamped or forgotten
    limits_hit: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_rejected: int = 0  # malformed / unknown / old-version / unauthenticated messages
    offers_refused: int = 0  # offers (or pulls) from an agent other than the transfer's bound peer
    peers_restarted: int = 0  # new instance id seen at a known endpoint
    spilled_layers: int = 0  # layers that landed in the spill pool (receive budget full)
    credit_waits: int = 0  # times granting stopped because budget and spill pool were full
    early_grants: int = 0  # transfers granted at expect time, before the sender's Offer (decision 110)
    early_grants_unused: int = 0  # ... dropped: other sizes offered, or the sender restarted
    trailers_missing: int = 0  # transfers completed at their deadline without the sender's trailer
    # push receives renewed by a live sender that had not heard of them yet (decision 128)
    admission_renewals: int = 0
    device_copy_bytes: int = 0  # bytes a plane copied on the GPU itself (CUDA IPC) ...
    device_copy_ns: int = 0  # ... and the device time those copies took
    device_copy_batches: int = 0  # ... in this many batches (one timed window each)
    spill_bytes_in_use: int = 0  # gauges at snapshot time
    budget_bytes_in_use: int = 0
    transfers_active: int = 0
    quarantined_transfers: int = 0  # receives a stalled sender may still write into (decision 114)
    quarantined_bytes: int = 0  # ... and the destination bytes they keep out of use


class ControlLimit(str, enum.Enum):
    """The control-plane limits a peer can hit (labels of ``limits_hit``; see ControlLimits)."""

    MESSAGE_BYTES = "control_message_bytes"  # a control frame over max_message_bytes (refused)
    FRAMES = "control_frames"  # a control message of more frames than the protocol has (refused)
    PEER_DEADLINE = "peer_deadline"  # an Offer/Pull lease outside our bounds (clamped)
    EARLY_GRANTS = "early_grants"  # an early Grant not kept: max_early_grants reached
    EARLY_GRANTS_PER_PEER = "early_grants_per_peer"  # ... max_early_grants_per_peer reached
    PENDING_PER_PEER = "pending_per_peer"  # an Offer or Pull refused: max_pending_per_peer reached
    PENDING_TRANSFERS = "pending_transfers"  # an Offer refused: max_pending_transfers reached
    PENDING_PULLS = "pending_pulls"  # a Pull refused: max_pending_pulls reached
    PEERS = "peers"  # a peer endpoint's epoch forgotten: max_peers reached


class StatsRecorder:
    """Thread-safe counters behind :class:`TransferStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._limits: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def failed(self, reason: str) -> None:
        """Count a failure under its reason's prefix when that is a known ``FailReason`` value,
        else under "other" (caller-given abort reasons must not grow metric label sets)."""
        label = FailReason.of(reason).value
        with self._lock:
            self._failed[label] += 1

    def limit_hit(self, limit: ControlLimit | str) -> None:
        label = ControlLimit(limit).value
        with self._lock:
            self._limits[label] += 1

    def snapshot(self, **gauges: int) -> TransferStats:
        with self._lock:
            counts = dict(self._counts)
            failed = dict(self._failed)
            limits = dict(self._limits)
        fields = {f.name for f in dataclasses.fields(TransferStats)}
        values = {k: v for k, v in counts.items() if k in fields}
        return TransferStats(failed=failed, limits_hit=limits, **values, **gauges)
