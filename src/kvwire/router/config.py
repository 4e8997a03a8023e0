"""Router configuration: one frozen dataclass built at the edge (CLI) and passed down."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvwire.discovery.address import DiscoveryAddress, DiscoveryKind, parse_discovery_address
from kvwire.errors import ConfigError
from kvwire.http.front_door import ApiKeyConfig
from kvwire.protocol.kv_params import TransferMode


class Policy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    RANDOM = "random"
    KV_AWARE = "kv_aware"  # prefix-cache overlap (KV events) minus load; decision 045


class PdFallback(str, enum.Enum):
    """What the router does with a request for a model that has a live decode instance but no live
    prefill instance (and no ``both`` one)."""

    COLOCATED = "colocated"  # D serves the whole request itself (warned, counted)
    ERROR = "error"  # 503, and /v1/models does not list the model


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP (OpenAI API); 0 = pick a free port
    discovery_host: str = "127.0.0.1"
    discovery_port: int = 8001  # ZeroMQ heartbeats; 0 = pick a free port
    # None: the embedded ZeroMQ heartbeat socket above; "etcd://HOST:PORT[/prefix]": watch etcd.
    discovery: str | None = None
    # No heartbeat for this long -> expired. 2.5 intervals at the instances' default 2 s: two missed
    # heartbeats and half an interval of grace, so a dead instance is out within 3 intervals of its
    # last heartbeat with the network's, the listener's and the sweeper's delays included (decision 109).
    instance_ttl_s: float = 5.0
    forget_after_s: float = 60.0  # expired entries stay visible in /instances this long
    policy: Policy = Policy.KV_AWARE  # decision 048
    mode: TransferMode = TransferMode.PUSH
    # HMAC key for heartbeats (unsigned ones are dropped) and kv_transfer_params; never in a repr or log
    secret: str | None = field(default=None, repr=False)
    kv_params_ttl_s: float = 60.0  # signed kv_transfer_params are refused by instances after this long
    api_keys: ApiKeyConfig = field(default_factory=ApiKeyConfig)  # keys clients must present (none: open)
    # Sent as 'Authorization: Bearer' to instances (their --api-key). None: the client's Authorization
    # header is passed on when the router has no keys of its own, else nothing.
    instance_api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    # A client connection with no complete request head for this long (a new connection, or idle
    # between requests) is closed: a slow-loris head cannot hold it. Longer than the keep-alive of
    # the router's own upstream pool (30 s) and of common clients (aiohttp 15 s), so they close first.
    http_idle_timeout_s: float = 60.0
    http_body_timeout_s: float = 30.0  # a request body that does not arrive in time: 408
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0  # whole upstream request, streaming included
    # A client that reads nothing for this long (one write stuck; streaming or a whole answer) is cut
    # off; its upstream requests still in flight are cancelled, like on a disconnect.
    client_write_timeout_s: float = 30.0
    kv_deadline_s: float = 30.0  # deadline_s put in kv_transfer_params: a lease renewed while P/D live
    kv_limit_s: float = 300.0  # limit_s put in kv_transfer_params: bound on a transfer however renewed
    max_migrations: int = 3  # times one request may move to another instance after one died
    max_connect_retries: int = 2  # re-dispatches when an upstream refuses the connection
    seed: int | None = None  # for the random policy (tests)
    # Push mode, streaming: send P's first token to the client as soon as P answers, and trim it off
    # the start of D's stream (P and D share a request id and a seed; a D that does not continue P's
    # token has its answer continued elsewhere, decision 121).
    stream_first_token_from_prefill: bool = True
    # kv_aware: when D holds all but fewer than this many prompt tokens, skip P and let D prefill the
    # rest itself (0 = never skip).
    decode_local_prefill_tokens: int = 256
    tokenizer: str | None = None  # "byte" or a local HF model dir; None = what instances announce
    kv_index_max_blocks: int = 1 << 20  # block hashes the KV index keeps (least recently stored go)
    # Bounds on what peers choose (decision 117). Instances the registry holds (expired ones until
    # forgotten included); a heartbeat of a new one beyond that is refused and counted.
    max_instances: int = 10_000
    # A heartbeat's promised ttl_s (etcd records) is clamped to this; negative/NaN counts as none.
    max_record_ttl_s: float = 60.0
    # With a secret: the first signed message of an instance's epoch must be sent within this many
    # seconds of the router's clock (replays refused: decision 125); etcd records get their ttl_s more.
    discovery_freshness_s: float = 30.0
    # Connections to instances: in all, and to one instance; a request beyond waits for one (counted).
    upstream_max_connections: int = 4096
    upstream_max_connections_per_instance: int = 1024
    # No live P for a model but a live D: serve on D as a colocated request, or answer 503 (decision 124).
    pd_fallback: PdFallback = PdFallback.COLOCATED

    def __post_init__(self) -> None:
        for name in ("port", "discovery_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be in 0..65535, got {value}")
        positive = (
            "instance_ttl_s", "forget_after_s", "connect_timeout_s", "upstream_timeout_s", "kv_deadline_s",
            "client_write_timeout_s", "kv_params_ttl_s", "kv_limit_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not (self.http_idle_timeout_s > 0 and self.http_body_timeout_s > 0):
            raise ConfigError("http_idle_timeout_s and http_body_timeout_s must be > 0, got "
                              f"{self.http_idle_timeout_s}, {self.http_body_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.decode_local_prefill_tokens < 0:
            raise ConfigError(
                f"decode_local_prefill_tokens must be >= 0, got {self.decode_local_prefill_tokens}"
            )
        for name in ("max_instances", "upstream_max_connections", "upstream_max_connections_per_instance"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.discovery_freshness_s < float("inf"):
            raise ConfigError(
                f"discovery_freshness_s must be > 0 and finite, got {self.discovery_freshness_s}")
        if not 0 < self.max_record_ttl_s < float("inf"):
            raise ConfigError(f"max_record_ttl_s must be > 0 and finite, got {self.max_record_ttl_s}")
        if self.kv_index_max_blocks <= 0:
            raise ConfigError(f"kv_index_max_blocks must be > 0, got {self.kv_index_max_blocks}")
        if self.kv_limit_s < self.kv_deadline_s:
            raise ConfigError(f"kv_limit_s must be >= kv_deadline_s, got {self.kv_limit_s}")
        if self.max_migrations < 0:
            raise ConfigError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.max_connect_retries < 0:
            raise ConfigError(f"max_connect_retries must be >= 0, got {self.max_connect_retries}")
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"policy must be a Policy, got {self.policy!r}")
        if not isinstance(self.mode, TransferMode):
            raise ConfigError(f"mode must be a TransferMode, got {self.mode!r}")
        if not isinstance(self.pd_fallback, PdFallback):
            raise ConfigError(f"pd_fallback must be a PdFallback, got {self.pd_fallback!r}")
        _ = self.discovery_target  # raises ConfigError for a bad discovery address

    @property
    def discovery_target(self) -> DiscoveryAddress | None:
        """The etcd prefix to watch, or None for the embedded ZeroMQ listener."""
        if self.discovery is None or self.discovery in ("", "zmq"):
            return None
        target = parse_discovery_address(self.discovery)
        if target.kind is not DiscoveryKind.ETCD:
            raise ConfigError(
                f"router --discovery takes zmq or etcd[+https]://HOST:PORT[/prefix], got {self.discovery!r} "
                "(the embedded heartbeat socket is set with --discovery-host/--discovery-port)"
            )
        return target

    @property
    def sweep_interval_s(self) -> float:
        """The longest the sweeper sleeps (a quarter of the TTL, at most 1 s); it also wakes at the
        earliest entry's expiry."""
        return min(1.0, self.instance_ttl_s / 4)

    @property
    def secret_bytes(self) -> bytes | None:
        return self.secret.encode() if self.secret else None
