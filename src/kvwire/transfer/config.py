"""Configuration of one :class:`~kvwire.transfer.agent.TransferAgent` (frozen, validated once).

Everything a process's config builder needs to make a :class:`TransferConfig` is importable from
here (:class:`ControlLimits`, :class:`DataLinkConfig`, :func:`nccl_from_env`): the server and the
vLLM plugin build it at their edge and never import a plane (decision 134).
"""

from __future__ import annotations

import dataclasses
import math

from kvwire.errors import ConfigError
from kvwire.transfer.enums import Backend, Transport
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.nccl.config import NcclPlaneConfig

__all__ = ["ControlLimits", "DataLinkConfig", "NcclPlaneConfig", "TransferConfig", "nccl_from_env"]

GiB = 1 << 30
MiB = 1 << 20


def nccl_from_env() -> NcclPlaneConfig:
    """The NCCL plane's tuning from ``KVWIRE_NCCL_*``: read once, at a process's edge (``kvwire
    serve``'s builder, the vLLM plugin's worker), and passed down inside :class:`TransferConfig`."""
    return NcclPlaneConfig.from_env()


@dataclasses.dataclass(frozen=True)
class ControlLimits:
    """Bounds on what a peer can make one agent's control plane hold or trust (decision 116).

    Every number a peer chooses is clamped or capped here: the size of a control message (checked
    before its MAC or any decoding, and by ZeroMQ itself: ``MAXMSGSIZE``), the lease of its Offer or
    Pull (clamped to ``[min_peer_deadline_s, max_peer_deadline_s]``; not finite: refused), what it
    may leave waiting here before this side knows the transfer (early Grants, Offers not expected
    yet, Pulls before ``start_send``: per peer and in all; the receive memory granted to a peer's
    Offers not expected yet, per peer) and how many peer endpoints are remembered (least recently
    heard of forgotten first). Each limit hit is counted in ``TransferStats.limits_hit``
    (``kvwire_transfer_limit_hits_total{limit}``).

    ``max_admission_wait_s`` (decision 128): how long after ``expect`` a push receiver keeps its lease
    renewed on the word of a live sender that has not heard of the transfer yet (the request still in
    its HTTP server or its engine's queue: it answers ``unknown``). A sender that never hears of it
    fails the transfer this long after ``expect`` (or at its limit); a silent one, within one lease.

    ``max_unsolicited_wait_s`` (decision 159): the other way round, how long a receiver keeps an Offer
    that ``expect`` has not named, from its arrival; Renews do not extend it. Past it the receive
    fails and its sender is told (an Abort: the send fails, the sender's blocks are freed); an
    ``expect`` of it afterwards raises ``TransferError``.
    """

    max_message_bytes: int = 4 * MiB  # one control frame (a control message never carries layer data)
    min_peer_deadline_s: float = 0.05  # a peer's Offer/Pull lease is clamped to [min, max]
    max_peer_deadline_s: float = 600.0
    max_early_grants: int = 4096  # Grants kept before start_send (decision 110), in all ...
    max_early_grants_per_peer: int = 1024  # ... and per receiver endpoint
    # per peer endpoint: its Offers not expected yet here, and its Pulls of transfers not started here
    max_pending_per_peer: int = 1024
    # per peer endpoint: receive memory (budget and spill) its Offers not expected yet may be granted;
    # an Offer past it waits for expect() (decision 150). 0: a quarter of recv_budget_bytes
    max_unexpected_bytes_per_peer: int = 0
    max_pending_pulls: int = 10_000  # Pulls (whole or piece) of transfers not started here, in all
    max_peers: int = 4096  # peer endpoints whose epoch is remembered (least recently heard forgotten)
    max_admission_wait_s: float = 30.0  # push receiver: a live sender's "unknown" renews this long
    max_unsolicited_wait_s: float = 30.0  # receiver: an Offer nobody expects is kept this long at most

    def __post_init__(self) -> None:
        if not 64 * 1024 <= self.max_message_bytes <= 1 << 30:
            raise ConfigError(f"max_message_bytes must be in [64 KiB, 1 GiB], got {self.max_message_bytes}")
        lo, hi = self.min_peer_deadline_s, self.max_peer_deadline_s
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
            raise ConfigError(f"peer deadline bounds must be finite with 0 < min <= max, got [{lo}, {hi}]")
        counts = ("max_early_grants", "max_early_grants_per_peer", "max_pending_per_peer",
                  "max_pending_pulls", "max_peers")
        for name in counts:
            if getattr(self, name) < 1:
                raise ConfigError(f"ControlLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_unexpected_bytes_per_peer < 0:
            unexpected = self.max_unexpected_bytes_per_peer
            raise ConfigError(f"ControlLimits.max_unexpected_bytes_per_peer must be >= 0, got {unexpected}")
        wait_s = self.max_admission_wait_s
        if not (math.isfinite(wait_s) and wait_s >= 0):
            raise ConfigError(f"max_admission_wait_s must be finite and >= 0, got {wait_s}")
        unsolicited_s = self.max_unsolicited_wait_s
        if not (math.isfinite(unsolicited_s) and unsolicited_s > 0):
            raise ConfigError(f"max_unsolicited_wait_s must be finite and > 0, got {unsolicited_s}")
        if self.max_early_grants_per_peer > self.max_early_grants:
            raise ConfigError("ControlLimits.max_early_grants_per_peer must be <= max_early_grants")


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """Settings of one transfer agent.

    ``recv_budget_bytes`` bounds the memory that received-but-not-yet-consumed layers may occupy on
    ``device``; beyond it layers go to a spill pool of at most ``spill_budget_bytes`` host memory
    (pinned when ``device`` is CUDA), allocated lazily. When both are full the receiver grants no
    more credit and senders wait (within their deadlines).

    ``transport`` picks the plane per peer (docs/decisions/075-plane-negotiation.md): ``auto`` holds
    the same-host plane of ``device`` (``shm`` on CPU) next to ``backend`` (the plane for peers on
    other hosts) and lets each pair of agents negotiate; a forced value holds that plane alone.

    ``advertise_*`` (docs/decisions/090-kv-advertise-address.md): what peers are told to connect to
    when it differs from what the agent binds (NAT, a TCP proxy, a Kubernetes Service, a fault
    relay): the control endpoint in every message's ``src_endpoint`` and the TCP data plane's address
    in every ``plane_info``. Unset (None / 0) = the bound host / port. Same-host planes (shm, ipc)
    and NCCL are not redirected: they do not dial the advertised TCP address.
    """

    host: str = "127.0.0.1"  # interface the control endpoint and the data plane bind to
    control_port: int = 0  # 0 = any free port (read agent.endpoint)
    backend: Backend = Backend.TCP  # the plane for peers on other hosts (tcp or nccl)
    transport: Transport = Transport.AUTO  # per-peer choice (auto) or one forced plane
    device: str = "cpu"  # "cpu" or "cuda[:N]": where received layers land
    recv_budget_bytes: int = 1 * GiB
    spill_budget_bytes: int = 1 * GiB
    default_deadline_s: float = 30.0  # lease: how long a transfer waits for a silent peer
    default_limit_s: float = 600.0  # overall bound on a transfer whose peer keeps renewing its lease
    # shared secret: peers that cannot prove it are refused; never in a repr or log (decision 124)
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    data_port: int = 0  # TCP data plane listening port (0 = any free port)
    socket_buffer_bytes: int = 8 * MiB  # SO_SNDBUF / SO_RCVBUF of data sockets
    max_layers_per_transfer: int = 4096  # protocol sanity bound on offers
    max_pending_transfers: int = 65536  # bound on transfers tracked per agent (each side)
    # bounds on what peers can make the control plane hold or trust (decision 116)
    limits: ControlLimits = dataclasses.field(default_factory=ControlLimits)
    shm_ring_bytes: int = 64 * MiB  # shared-memory plane: staging ring per inbound peer link
    advertise_host: str | None = None  # host peers dial (None: ``host``)
    advertise_control_port: int = 0  # control port peers dial (0: the bound one)
    advertise_data_port: int = 0  # TCP data port peers dial (0: the bound one)
    # shared-memory plane: threads (the writer's own included) that copy one layer's block runs
    # straight into a peer's shared KV cache (the one-copy path, decision 080)
    shm_copy_threads: int = 1
    # The NCCL plane's tuning (used with backend NCCL). Built at the edge: the CLI / plugin reads
    # KVWIRE_NCCL_* once (NcclPlaneConfig.from_env) and passes it down; nothing below reads the env.
    nccl: NcclPlaneConfig = dataclasses.field(default_factory=NcclPlaneConfig)
    # Data-plane links (tcp, shm, ipc): connection caps per listener and per peer, the handshake
    # deadline, heartbeats and the deadline of a link that moves nothing (decision 115).
    links: DataLinkConfig = dataclasses.field(default_factory=DataLinkConfig)

    def __post_init__(self) -> None:
        if isinstance(self.secret, str):  # accept str for convenience; store bytes
            object.__setattr__(self, "secret", self.secret.encode())
        if not isinstance(self.backend, Backend):
            try:
                object.__setattr__(self, "backend", Backend(self.backend))
            except ValueError as exc:
                raise ConfigError(f"TransferConfig.backend: unknown backend {self.backend!r}") from exc
        if not isinstance(self.transport, Transport):
            try:
                object.__setattr__(self, "transport", Transport(self.transport))
            except ValueError as exc:
                choices = "|".join(t.value for t in Transport)
                msg = f"TransferConfig.transport: {self.transport!r} is not one of {choices}"
                raise ConfigError(msg) from exc
        self._check_transport()
        for name in ("control_port", "data_port", "advertise_control_port", "advertise_data_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"TransferConfig.{name} must be in 0..65535, got {port}")
        if self.recv_budget_bytes <= 0 or self.spill_budget_bytes < 0:
            raise ConfigError("TransferConfig: recv_budget_bytes must be > 0 and spill_budget_bytes >= 0")
        if self.default_deadline_s <= 0:
            raise ConfigError("TransferConfig.default_deadline_s must be > 0")
        if self.default_limit_s < self.default_deadline_s:
            raise ConfigError("TransferConfig.default_limit_s must be >= default_deadline_s")
        if self.secret is not None and len(self.secret) == 0:
            raise ConfigError("TransferConfig.secret must be non-empty (or None)")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"TransferConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.backend is Backend.NCCL and not self.device.startswith("cuda"):
            raise ConfigError("TransferConfig: the NCCL backend needs a CUDA device")
        if self.socket_buffer_bytes <= 0 or self.max_layers_per_transfer <= 0:
            raise ConfigError("TransferConfig: socket_buffer_bytes and max_layers_per_transfer must be > 0")
        if self.max_pending_transfers < 1:
            pending = self.max_pending_transfers
            raise ConfigError(f"TransferConfig.max_pending_transfers must be >= 1, got {pending}")
        if not isinstance(self.limits, ControlLimits):
            raise ConfigError(f"TransferConfig.limits must be a ControlLimits, got {self.limits!r}")
        if not self.host:
            raise ConfigError("TransferConfig.host must not be empty")
        if self.advertise_host is not None and not self.advertise_host.strip():
            raise ConfigError("TransferConfig.advertise_host must not be empty (None: the bound host)")
        if self.shm_ring_bytes < 1 * MiB:
            raise ConfigError("TransferConfig.shm_ring_bytes must be at least 1 MiB")
        if not 1 <= self.shm_copy_threads <= 64:
            raise ConfigError("TransferConfig.shm_copy_threads must be between 1 and 64")
        if not isinstance(self.links, DataLinkConfig):
            raise ConfigError(f"TransferConfig.links must be a DataLinkConfig, got {self.links!r}")

    @property
    def unexpected_bytes_per_peer(self) -> int:
        """Receive memory one peer's Offers not expected yet may be granted (decision 150): the
        limit given, else a quarter of the receive budget."""
        return self.limits.max_unexpected_bytes_per_peer or max(1, self.recv_budget_bytes // 4)

    def _check_transport(self) -> None:
        if self.backend not in (Backend.TCP, Backend.NCCL):
            raise ConfigError(
                "TransferConfig.backend is the plane for other hosts (tcp or nccl), "
                f"got {self.backend.value!r}; "
                "choose same-host planes with transport"
            )
        cuda = self.device.startswith("cuda")
        if self.transport is Transport.SHM and cuda:
            raise ConfigError("transport 'shm' moves CPU tensors; a CUDA device uses 'ipc' (or 'auto')")
        if self.transport in (Transport.IPC, Transport.NCCL) and not cuda:
            raise ConfigError(
                f"transport {self.transport.value!r} needs a CUDA device (device is {self.device!r})"
            )

    def for_rank(self, rank: int, device: str) -> TransferConfig:
        """Tensor-parallel rank ``rank``'s copy on ``device``: every fixed port (bound and advertised)
        becomes ``port + rank``; 0 (any free port / the bound one) stays 0."""
        return dataclasses.replace(
            self,
            control_port=_shift(self.control_port, rank),
            data_port=_shift(self.data_port, rank),
            advertise_control_port=_shift(self.advertise_control_port, rank),
            advertise_data_port=_shift(self.advertise_data_port, rank),
            device=device,
        )

    def advertised(self, bound: str, port: int) -> str:
        """``host:port`` peers dial for a socket bound at ``bound`` (``host:port``), given the
        ``advertise_*`` port of that socket (0: the bound port)."""
        bound_host, _, bound_port = bound.rpartition(":")
        host = self.advertise_host or bound_host
        return f"{host}:{port or bound_port}"


def _shift(port: int, rank: int) -> int:
    """Rank ``rank``'s copy of a fixed port (0 = any free port stays 0)."""
    return port + rank if port else 0
