"""Configuration of one :class:`~kvwire.transfer.agent.TransferAgent` (frozen, validated once)."""

from __future__ import annotations

import dataclasses

from kvwire.errors import ConfigError
from kvwire.transfer.types import Backend

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """Settings of one transfer agent.

    ``recv_budget_bytes`` bounds the memory that received-but-not-yet-consumed layers may occupy on
    ``device``; beyond it layers go to a spill pool of at most ``spill_budget_bytes`` host memory
    (pinned when ``device`` is CUDA), allocated lazily. When both are full the receiver grants no
    more credit and senders wait (within their deadlines).
    """

    host: str = "127.0.0.1"  # interface the control endpoint and the data plane bind to
    control_port: int = 0  # 0 = any free port (read agent.endpoint)
    backend: Backend = Backend.TCP
    device: str = "cpu"  # "cpu" or "cuda[:N]": where received layers land
    recv_budget_bytes: int = 1 * GiB
    spill_budget_bytes: int = 1 * GiB
    default_deadline_s: float = 30.0  # lease: how long a transfer waits for a silent peer
    default_limit_s: float = 600.0  # overall bound on a transfer whose peer keeps renewing its lease
    secret: bytes | None = None  # shared secret: peers that cannot prove it are refused
    data_port: int = 0  # TCP data plane listening port (0 = any free port)
    socket_buffer_bytes: int = 8 * MiB  # SO_SNDBUF / SO_RCVBUF of data sockets
    max_layers_per_transfer: int = 4096  # protocol sanity bound on offers
    max_pending_transfers: int = 65536  # bound on transfers tracked per agent

    def __post_init__(self) -> None:
        if isinstance(self.secret, str):  # accept str for convenience; store bytes
            object.__setattr__(self, "secret", self.secret.encode())
        if not isinstance(self.backend, Backend):
            try:
                object.__setattr__(self, "backend", Backend(self.backend))
            except ValueError as exc:
                raise ConfigError(f"TransferConfig.backend: unknown backend {self.backend!r}") from exc
        for name in ("control_port", "data_port"):
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
        if not self.host:
            raise ConfigError("TransferConfig.host must not be empty")
