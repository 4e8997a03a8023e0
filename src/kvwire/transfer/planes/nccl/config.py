"""Tuning of the NCCL data plane (frozen, validated; ``from_env`` reads ``KVWIRE_NCCL_*`` at the edge)."""

from __future__ import annotations

import dataclasses
import os

from kvwire.errors import ConfigError
from kvwire.transfer.planes.nccl.bindings import CommConfig
from kvwire.transfer.planes.nccl.plane_info import MAX_LANES

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class NcclPlaneConfig:
    """Tuning of the NCCL data plane (``from_env`` reads ``KVWIRE_NCCL_*`` at the edge)."""

    min_ctas: int | None = None  # NCCL channels (thread blocks) per communicator; None = NCCL default
    max_ctas: int | None = None
    # consecutive layers of one transfer coalesce up to this per message (with one lane each message
    # boundary costs the wire ~10-15 us of NCCL start-up; with two it is hidden, but more messages
    # than ~16 per transfer still cost; graph_probe sweeps in docs/performance.md, decision 067)
    chunk_bytes: int = 96 * MiB
    # The first and the last message of a transfer carry only this much (at least one layer): the
    # sender's gather before the first byte moves and the receiver's scatter after the last byte lands
    # are not overlapped with the wire, so they should be short (see message_ranges). 0: no edges.
    edge_bytes: int = 8 * MiB
    # Messages grow from the edges inward by up to this factor (2..8; 0: edge, then the balanced
    # middle): fewer boundaries, copies still hidden as long as it stays below the copy/wire speed
    # ratio (~5-7 on H200 with the bounded copy grid; graph_probe, docs/performance.md).
    ramp: int = 4
    # Communicators per channel (1..4), each on its own stream; a transfer's messages take turns
    # (the receiver assigns them in its chunk plans). The next message's NCCL start-up (~14 us on
    # H200: launch, rendezvous, first steps) then overlaps the current message's data instead of
    # following it, and a transfer's middle is cut into a multiple of this many messages. Each lane
    # costs a communicator's GPU memory (decision 061) and an IPC mapping of every registered buffer.
    lanes: int = 2
    # Sender: captured CUDA graphs kept per channel (a whole run of one transfer's messages replayed
    # with one call; see nccl_graphs). 0: never capture.
    send_graphs: int = 8
    max_comms: int = 64  # receive-side channels (one per sending peer epoch, each of `lanes` communicators)
    idle_close_s: float = 120.0  # a receive communicator unused this long is destroyed
    init_timeout_s: float = 60.0  # communicator join deadline
    stall_timeout_s: float = 60.0  # an operation in flight longer than this aborts the communicator
    # Chunks posted to NCCL and not completed, per channel. Bounded so NCCL's host->GPU work FIFO (held by
    # queued kernels until they finish) never fills: a full FIFO makes ncclGroupEnd block.
    max_inflight_chunks: int = 32
    # Sender: chunk plans kept per channel, as a window ahead of the channel's next message (decision
    # 150). A receiver plans only what it granted; a plan this many messages ahead fails the channel
    # (its transfers fail peer_lost) instead of being kept, so a peer cannot grow the table.
    max_plans: int = 65536
    # Zero-copy messages (NCCL user buffer registration, decision 066): a receiver offering it makes
    # both ends of its communicator pass only registered memory (ncclMemAlloc: the plane's
    # allocate_zero_copy slabs, else a pooled staging buffer), and NCCL's sender then writes straight
    # into the receiver's buffer instead of through a FIFO the receiving kernel copies out (which made
    # every byte cross the receiver's HBM three times). The receiver decides per communicator (in its
    # offer); the sender follows. Needs NCCL >= 2.19 (off otherwise).
    zero_copy: bool = True
    # Gathers and scatters with slack run on this share of the SMs (group_kernels.copy_share): a
    # message's gather when two messages of its transfer leave before it, a message's scatter when two
    # land after it. At full width such a copy saturates HBM in a burst and slows the NCCL kernel
    # beside it; the first gathers and the last scatters (the exposed ones) keep every SM. 1.0: off.
    slack_copy_share: float = 0.5

    def __post_init__(self) -> None:
        CommConfig(self.min_ctas, self.max_ctas)  # validates the CTA bounds
        if self.chunk_bytes < 1 * MiB:
            raise ConfigError("NcclPlaneConfig.chunk_bytes must be >= 1 MiB")
        if self.edge_bytes < 0:
            raise ConfigError("NcclPlaneConfig.edge_bytes must be >= 0")
        if self.ramp != 0 and not 2 <= self.ramp <= 8:
            raise ConfigError("NcclPlaneConfig.ramp must be 0 or in [2, 8]")
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigError(f"NcclPlaneConfig.lanes must be in [1, {MAX_LANES}]")
        if not 0 <= self.send_graphs <= 256:
            raise ConfigError("NcclPlaneConfig.send_graphs must be in [0, 256]")
        if self.max_comms < 1:
            raise ConfigError("NcclPlaneConfig.max_comms must be >= 1")
        if not 1 <= self.max_inflight_chunks <= 512:
            raise ConfigError("NcclPlaneConfig.max_inflight_chunks must be in [1, 512]")
        if not 1 <= self.max_plans <= 1 << 24:
            raise ConfigError("NcclPlaneConfig.max_plans must be in [1, 2**24]")
        if not 0.0 < self.slack_copy_share <= 1.0:
            raise ConfigError("NcclPlaneConfig.slack_copy_share must be in (0, 1]")
        if min(self.idle_close_s, self.init_timeout_s, self.stall_timeout_s) <= 0:
            raise ConfigError("NcclPlaneConfig timeouts must be > 0")

    @classmethod
    def from_env(cls) -> NcclPlaneConfig:
        def opt_int(name: str) -> int | None:
            value = os.environ.get(name)
            return int(value) if value else None

        chunk_mib = opt_int("KVWIRE_NCCL_CHUNK_MIB")
        stall = os.environ.get("KVWIRE_NCCL_STALL_S")
        edge_mib = opt_int("KVWIRE_NCCL_EDGE_MIB")
        ramp = opt_int("KVWIRE_NCCL_RAMP")
        graphs = opt_int("KVWIRE_NCCL_GRAPHS")
        zero_copy = os.environ.get("KVWIRE_NCCL_ZERO_COPY")
        share = os.environ.get("KVWIRE_NCCL_SLACK_COPY_SHARE")
        lanes = opt_int("KVWIRE_NCCL_LANES")
        max_plans = opt_int("KVWIRE_NCCL_MAX_PLANS")
        defaults = cls()
        chunk = chunk_mib * MiB if chunk_mib else defaults.chunk_bytes
        edge = edge_mib * MiB if edge_mib is not None else defaults.edge_bytes
        return cls(
            min_ctas=opt_int("KVWIRE_NCCL_MIN_CTAS"),
            max_ctas=opt_int("KVWIRE_NCCL_MAX_CTAS"),
            chunk_bytes=chunk,
            edge_bytes=edge,
            ramp=ramp if ramp is not None else defaults.ramp,
            send_graphs=graphs if graphs is not None else defaults.send_graphs,
            stall_timeout_s=float(stall) if stall else defaults.stall_timeout_s,
            zero_copy=_flag(zero_copy) if zero_copy else defaults.zero_copy,
            slack_copy_share=float(share) if share else defaults.slack_copy_share,
            lanes=lanes if lanes is not None else defaults.lanes,
            max_plans=max_plans if max_plans is not None else defaults.max_plans,
        )

    @property
    def comm_config(self) -> CommConfig:
        # Blocking mode: ncclGroupEnd returns once the work is on the stream (a non-blocking comm hands
        # every group to a helper thread: ~0.4 ms per launch measured). Deadlines come from the joiner
        # thread (init) and the plane's janitor (stalls), which abort the communicator.
        return CommConfig(min_ctas=self.min_ctas, max_ctas=self.max_ctas, blocking=True)


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off")
