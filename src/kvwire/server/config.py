"""Configuration of one ``kvwire serve`` instance (everything but the engine's own sizing).

Built once at the edge (:func:`kvwire.server.cli.serve_configs_from_args`) and passed down; validated
in ``__post_init__``. The KV transfer agent's settings travel inside it as one
:class:`~kvwire.transfer.config.TransferConfig` that the server hands to the connector without
looking inside (docs/decisions/134-config-builders-and-packages.md).
"""

from __future__ import annotations

import dataclasses

from kvwire.discovery.address import parse_registration_address
from kvwire.errors import ConfigError
from kvwire.http.front_door import ApiKeyConfig
from kvwire.protocol.kv_params import LoadFailurePolicy, Role, TransferMode
from kvwire.transfer.config import TransferConfig

# The one policy enum (kvwire.protocol.kv_params); this name is the server's spelling of it.
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
    # P/D connector defaults (the router's per-request kv_transfer_params may override mode/deadline).
    kv_mode: TransferMode = TransferMode.PUSH
    kv_deadline_s: float = 30.0  # push transfer deadline and pull lease on P's blocks
    # D: what to do when remote KV does not arrive (recompute the prompt locally, or fail the request).
    kv_load_failure_policy: KVLoadFailure = KVLoadFailure.RECOMPUTE
    # The KV transfer agent of role prefill/decode (unused for both), built by the CLI from --kv-port,
    # --kv-data-port, --kv-advertise-*, --kv-transport, --kv-max-*, --kv-data-*, KVWIRE_NCCL_*, the
    # device and the secret. Passed to the connector as it is: the server reads none of its fields.
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
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
    # Keys clients (the router) must send as 'Authorization: Bearer'; none = open (kvwire.http.front_door).
    api_keys: ApiKeyConfig = dataclasses.field(default_factory=ApiKeyConfig)
    # Requests admitted but not yet computing (waiting for a batch slot or for remote KV) at most;
    # one more is answered 429 with Retry-After (decision 117). 0 = no bound.
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ConfigError(f"role must be a Role, got {self.role!r}")
        if not isinstance(self.kv_mode, TransferMode):
            raise ConfigError(f"kv_mode must be a TransferMode, got {self.kv_mode!r}")
        if not isinstance(self.kv_load_failure_policy, KVLoadFailure):
            policy = self.kv_load_failure_policy
            raise ConfigError(f"kv_load_failure_policy must be a KVLoadFailure, got {policy!r}")
        if self.kv_deadline_s <= 0:
            raise ConfigError(f"kv_deadline_s must be > 0, got {self.kv_deadline_s}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not isinstance(self.transfer, TransferConfig):
            raise ConfigError(f"transfer must be a TransferConfig, got {self.transfer!r}")
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
        return public_host(self.host, self.advertise_host)


def public_host(host: str, advertise_host: str | None) -> str:
    """``advertise_host``, else ``host`` (127.0.0.1 for a wildcard bind)."""
    if advertise_host:
        return advertise_host
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
