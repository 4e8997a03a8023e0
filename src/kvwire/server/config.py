"""Configuration of one ``kvwire serve`` instance (everything but the engine's own sizing).

Built once at the edge (:mod:`kvwire.server.cli`) and passed down; validated in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses

from kvwire.auth import ApiKeyConfig
from kvwire.discovery.address import parse_registration_address
from kvwire.enum_values import as_enum
from kvwire.errors import ConfigError
from kvwire.kv_params import LoadFailurePolicy, Role, TransferMode
from kvwire.transfer.config import ControlLimits
from kvwire.transfer.enums import Transport
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.nccl.config import NcclPlaneConfig

# The one policy enum (kvwire.kv_params); this name is the server's spelling of it.
KVLoadFailure = LoadFailurePolicy


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = pick a free port (the chosen one is logged and used for registration)
    role: Role = Role.BOTH
    # Name clients must send as ``model``; None = the engine's model name.
    served_model_name: str | None = None
    # ``tcp://HOST:PORT`` of the router's discovery socket (several, comma-separated: every router
    # gets every heartbeat) or ``etcd://HOST:PORT[/prefix]``; None = run standalone.
    router_address: str | None = None
    heartbeat_interval_s: float = 2.0
    # Stable name for the router; None = a random one per process start.
    instance_id: str | None = None
    # Host put in the URL advertised to the router; None = ``host`` (127.0.0.1 for a wildcard bind).
    advertise_host: str | None = None
    # Port of this instance's KV transfer agent (role prefill/decode); 0 = any free port.
    kv_port: int = 0
    kv_data_port: int = 0  # its TCP data plane's port; 0 = any free port
    # What P/D peers dial when it is not what the agent binds (NAT, a proxy, a Kubernetes Service;
    # decision 090): host (the agent then binds ``host``, which may be a wildcard), control and data
    # ports (0 = the bound ones). None / 0 = advertise what is bound.
    kv_advertise_host: str | None = None
    kv_advertise_port: int = 0
    kv_advertise_data_port: int = 0
    # P/D connector defaults (the router's per-request kv_transfer_params may override mode/deadline).
    kv_mode: TransferMode = TransferMode.PUSH
    kv_deadline_s: float = 30.0  # push transfer deadline and pull lease on P's blocks
    # Data plane per peer: negotiated (auto: shm on one host for CPU, else tcp / nccl) or forced.
    kv_transport: Transport = Transport.AUTO
    # D: what to do when remote KV does not arrive (recompute the prompt locally, or fail the request).
    kv_load_failure_policy: KVLoadFailure = KVLoadFailure.RECOMPUTE
    # NCCL data plane tuning (--device cuda P/D); the CLI reads KVWIRE_NCCL_* once into it.
    kv_nccl: NcclPlaneConfig = dataclasses.field(default_factory=NcclPlaneConfig)
    # What P/D peers can make the KV agent's control plane hold or trust (--kv-max-*; decision 116).
    kv_limits: ControlLimits = dataclasses.field(default_factory=ControlLimits)
    kv_max_pending_transfers: int = 65536  # transfers the KV agent tracks per side
    # Data-plane listener caps and link deadlines (--kv-data-max-connections ... ; decision 115).
    kv_data_links: DataLinkConfig = dataclasses.field(default_factory=DataLinkConfig)
    # SIGTERM/SIGINT: everything (abort in-flight, deregister, stop the engine thread) within this.
    shutdown_deadline_s: float = 10.0
    # SIGUSR1 (drain, decision 120): deregister, refuse new requests, and let those in flight finish
    # (their KV sent, for P) for at most this long before stopping as on SIGTERM.
    drain_timeout_s: float = 60.0
    max_request_bytes: int = 16 * 1024 * 1024
    # A connection with no complete request head for this long (new, or idle between requests) is
    # closed, so a slow-loris head cannot hold it; longer than the router's upstream keep-alive (30 s),
    # so the router closes its idle pooled connections first.
    http_idle_timeout_s: float = 60.0
    http_body_timeout_s: float = 30.0  # a request body that does not arrive in time: 408
    # A client that reads nothing of its response for this long (one SSE write, or a non-streaming
    # body, stuck) is cut off and its request aborted in the engine, like a disconnect.
    client_write_timeout_s: float = 30.0
    # No engine step completed for this long while requests wait: they fail with 503 and /health turns
    # 503 until the engine makes progress again. Must exceed the longest legitimate step (a first CUDA
    # compile included). None or 0 = no watchdog.
    engine_stall_timeout_s: float | None = 120.0
    # Keys clients (the router) must send as 'Authorization: Bearer'; none = open (kvwire.auth).
    api_keys: ApiKeyConfig = dataclasses.field(default_factory=ApiKeyConfig)
    # Requests admitted but not yet computing (waiting for a batch slot or for remote KV) at most;
    # one more is answered 429 with Retry-After (decision 117). 0 = no bound.
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ConfigError(f"role must be a Role, got {self.role!r}")
        if not isinstance(self.kv_mode, TransferMode):
            raise ConfigError(f"kv_mode must be a TransferMode, got {self.kv_mode!r}")
        object.__setattr__(self, "kv_transport", as_enum(Transport, self.kv_transport, "kv_transport"))
        if not isinstance(self.kv_load_failure_policy, KVLoadFailure):
            policy = self.kv_load_failure_policy
            raise ConfigError(f"kv_load_failure_policy must be a KVLoadFailure, got {policy!r}")
        if self.kv_deadline_s <= 0:
            raise ConfigError(f"kv_deadline_s must be > 0, got {self.kv_deadline_s}")
        if self.kv_max_pending_transfers < 1:
            raise ConfigError(f"kv_max_pending_transfers must be >= 1, got {self.kv_max_pending_transfers}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("kv_port", "kv_data_port", "kv_advertise_port", "kv_advertise_data_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.kv_advertise_host is not None and not self.kv_advertise_host.strip():
            raise ConfigError("kv_advertise_host must not be empty (omit it to advertise the bound host)")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if self.shutdown_deadline_s <= 0:
            raise ConfigError(f"shutdown_deadline_s must be > 0, got {self.shutdown_deadline_s}")
        if self.drain_timeout_s <= 0:
            raise ConfigError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        if self.client_write_timeout_s <= 0:
            raise ConfigError(f"client_write_timeout_s must be > 0, got {self.client_write_timeout_s}")
        if self.engine_stall_timeout_s is not None and self.engine_stall_timeout_s < 0:
            timeout_s = self.engine_stall_timeout_s
            raise ConfigError(f"engine_stall_timeout_s must be >= 0 (0: off), got {timeout_s}")
        if self.max_waiting_requests < 0:
            waiting = self.max_waiting_requests
            raise ConfigError(f"max_waiting_requests must be >= 0 (0: no bound), got {waiting}")
        if not (self.http_idle_timeout_s > 0 and self.http_body_timeout_s > 0):
            raise ConfigError("http_idle_timeout_s and http_body_timeout_s must be > 0, got "
                              f"{self.http_idle_timeout_s}, {self.http_body_timeout_s}")
        if self.max_request_bytes <= 0:
            raise ConfigError(f"max_request_bytes must be > 0, got {self.max_request_bytes}")
        if self.router_address is not None:
            parse_registration_address(self.router_address)  # raises ConfigError with the accepted forms
        if self.served_model_name is not None and not self.served_model_name:
            raise ConfigError("served_model_name must not be empty")

    def public_host(self) -> str:
        """Host other processes use to reach this instance."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def kv_bind_host(self) -> str:
        """Interface the KV transfer agent binds: ``host`` itself (a wildcard included) when peers are
        told another host (``kv_advertise_host``), else the host it advertises (:meth:`public_host`)."""
        return self.host if self.kv_advertise_host else self.public_host()
