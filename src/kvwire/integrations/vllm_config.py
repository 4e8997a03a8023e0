"""vLLM's ``kv_transfer_config`` translated, once, into kvwire's frozen configuration.

This module imports neither vLLM nor torch: the mapping is pure and tested in the main venv.
:func:`plugin_config_from_vllm` reads a :class:`VllmTransferView` (the few fields of vLLM's
``KVTransferConfig`` that matter) and returns a validated :class:`VllmPluginConfig`; every key of
``kv_connector_extra_config`` that is neither one of the seed's (P2pNcclConnector) keys nor one of
kvwire's own fails with a :class:`~kvwire.errors.ConfigError` that lists the accepted keys. It is the
plugin's one config builder: the transfer agents' :class:`~kvwire.transfer.config.TransferConfig` is
made here too (``KVWIRE_NCCL_*`` read here, once per process), and each worker takes its rank's copy
(:meth:`~kvwire.transfer.config.TransferConfig.for_rank`).

Seed keys and what they become (docs/vllm.md has the full migration table):

* ``kv_port`` (top level) -> rank ``r``'s transfer-agent control port ``kv_port + r``; vLLM's default
  (14579) means "any free port" because vLLM cannot tell us whether it was set explicitly.
* ``kv_buffer_size`` (bytes; must move into ``kv_connector_extra_config``: vLLM >= 0.32 rejects it at
  the top level) -> the agent's receive budget.
* ``proxy_ip`` + ``proxy_port`` -> the kvwire router's discovery address ``tcp://ip:port``
  (kvwire's own key ``discovery`` takes ``tcp://HOST:PORT`` or ``etcd://HOST:PORT[/prefix]`` instead).
* ``http_port`` -> the OpenAI API URL advertised to the router (``http://http_host:http_port``).
* ``send_type`` ``PUT`` / ``PUT_ASYNC`` -> push mode, ``GET`` -> pull mode.
* ``nccl_num_channels`` -> ``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS`` for the NCCL data plane.
* ``mem_pool_size_gb`` -> the agent's host spill pool.

kvwire's control-plane bounds (decision 116; ``kvwire serve --kv-max-*``) take the names of
:class:`~kvwire.transfer.config.ControlLimits`' fields (``max_message_bytes``, ``max_peer_deadline_s``,
``max_early_grants_per_peer`` ...) plus ``max_pending_transfers``.
kvwire's data-link bounds (decision 115) map to :class:`~kvwire.transfer.config.DataLinkConfig`:
``data_max_connections``, ``data_max_connections_per_peer``, ``data_handshake_timeout_s``,
``data_keepalive_s``, ``data_link_timeout_s``, ``data_max_granted_dests_per_peer``,
``data_max_granted_dests``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvwire.connector.config import ConnectorConfig, LoadFailurePolicy
from kvwire.discovery.address import parse_registration_address
from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import Role, TransferMode
from kvwire.secrets_config import check_secret, load_secret, read_secret_file
from kvwire.transfer.config import ControlLimits, DataLinkConfig, TransferConfig, nccl_from_env
from kvwire.transfer.enums import Backend, Transport

VLLM_DEFAULT_KV_PORT = 14579  # KVTransferConfig.kv_port's default in vLLM
GiB = 1 << 30

SEED_KEYS = frozenset(
    {"proxy_ip", "proxy_port", "http_port", "send_type", "nccl_num_channels", "mem_pool_size_gb",
     "kv_buffer_size"}
)
KVWIRE_KEYS = frozenset(
    {"router", "discovery", "host", "http_host", "mode", "deadline_s", "lease_s", "backend", "transport",
     "recv_budget_bytes", "spill_budget_bytes", "secret", "secret_file", "heartbeat_interval_s",
     "instance_id", "model_name", "data_port", "advertise_host", "advertise_port", "advertise_data_port",
     "fault_delay_send",
     # data-plane link bounds (DataLinkConfig, decision 115)
     "data_max_connections", "data_max_connections_per_peer", "data_handshake_timeout_s", "data_keepalive_s",
     "data_link_timeout_s", "data_max_granted_dests_per_peer", "data_max_granted_dests"}
)
# the agent's control-plane bounds (decision 116): ControlLimits' own field names, and the transfer cap
LIMIT_KEYS = frozenset(f.name for f in dataclasses.fields(ControlLimits))
PENDING_KEY = "max_pending_transfers"
_SEND_TYPES = {"PUT": TransferMode.PUSH, "PUT_ASYNC": TransferMode.PUSH, "GET": TransferMode.PULL}
_ROLES = {
    "kv_producer": Role.PREFILL,
    "kv_consumer": Role.DECODE,
    "kv_both": Role.BOTH,
}


@dataclasses.dataclass(frozen=True)
class VllmTransferView:
    """The fields of vLLM's ``KVTransferConfig`` the plugin reads (built by the plugin, or by tests)."""

    kv_role: str | None
    kv_port: int = VLLM_DEFAULT_KV_PORT
    kv_buffer_device: str = "cpu"
    kv_load_failure_policy: str = "fail"
    engine_id: str | None = None
    kv_connector_extra_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> VllmTransferView:
        """Read a vLLM ``KVTransferConfig`` (duck-typed: no vLLM import here)."""
        return cls(
            kv_role=kv_transfer_config.kv_role,
            kv_port=int(kv_transfer_config.kv_port),
            kv_buffer_device=str(kv_transfer_config.kv_buffer_device),
            kv_load_failure_policy=str(getattr(kv_transfer_config, "kv_load_failure_policy", "fail")),
            engine_id=kv_transfer_config.engine_id,
            kv_connector_extra_config=dict(kv_transfer_config.kv_connector_extra_config or {}),
        )


@dataclasses.dataclass(frozen=True)
class SendDelayFault:
    """Fault injection for tests and drills, never for production (``fault_delay_send``): a prefill
    step that sends a transfer whose id starts with ``transfer_id_prefix`` is held ``seconds`` after
    its promises are renewed and before its sends start -- a P whose prefill starts late (an
    oversubscribed host, a long queue) while it stays alive and renews its peers' leases."""

    seconds: float
    transfer_id_prefix: str = ""  # "" = every transfer

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= 3600:
            raise ConfigError(f"kv_connector_extra_config.fault_delay_send.seconds must be in (0, 3600], "
                              f"got {self.seconds}")

    def applies(self, transfer_ids: list[str]) -> bool:
        return any(tid.startswith(self.transfer_id_prefix) for tid in transfer_ids)


@dataclasses.dataclass(frozen=True)
class VllmPluginConfig:
    """Everything the vLLM plugin needs, validated. One per vLLM instance (all ranks share it)."""

    connector: ConnectorConfig
    # Rank 0's transfer agent (fixed ports are bases: rank r takes ``transfer.for_rank(r, device)``);
    # its device is "cpu" or "cuda" (where vLLM's KV cache lives; the worker names the GPU).
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    # The shared secret as text: the scheduler side signs and verifies with it; ``transfer`` holds
    # its bytes. Never in a repr or log.
    secret: str | None = dataclasses.field(default=None, repr=False)
    router_address: str | None = None  # "tcp://host:port" or "etcd://host:port[/prefix]"; None = none
    # The mode set by send_type / mode (None: not set); a router in the other mode overrides it.
    configured_mode: TransferMode | None = None
    http_url: str | None = None  # advertised OpenAI API base, needed when router_address is set
    heartbeat_interval_s: float = 2.0
    instance_id: str | None = None  # stable name; None = vLLM's engine_id
    model_name: str | None = None  # advertised model; None = vLLM's served model name
    nccl_num_channels: int | None = None
    vllm_failure_policy: LoadFailurePolicy = LoadFailurePolicy.FAIL  # vLLM applies it (informational)
    fault_delay_send: SendDelayFault | None = None  # tests and drills only

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if self.router_address is not None and self.http_url is None:
            raise ConfigError(
                "registering with the router (router / proxy_ip+proxy_port) needs the instance's "
                "OpenAI API port: set kv_connector_extra_config.http_port"
            )
        if self.nccl_num_channels is not None and self.nccl_num_channels <= 0:
            raise ConfigError(f"nccl_num_channels must be > 0, got {self.nccl_num_channels}")

    @property
    def device_type(self) -> str:
        """"cpu" or "cuda": where vLLM's KV cache lives."""
        return self.transfer.device


# --- typed readers (JSON values arrive untyped) ------------------------------------------------------


def _get_str(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a non-empty string, got {value!r}")
    return value


def _plugin_secret(extra: Mapping[str, Any]) -> str | None:
    """The shared secret: ``secret_file`` (a file naming it, decision 124), else ``secret`` (on vLLM's
    command line: visible in ``ps``), else ``$KVWIRE_SECRET``; at least 32 bytes."""
    path, inline = _get_str(extra, "secret_file"), _get_str(extra, "secret")
    if path and inline:
        raise ConfigError("kv_connector_extra_config: give secret_file or secret, not both")
    if path:
        return read_secret_file(path)
    if inline:
        return check_secret(inline, "kv_connector_extra_config.secret")
    return load_secret(None)


def _get_int(extra: Mapping[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"kv_connector_extra_config.{key} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config.{key} must be an integer, got {value!r}") from exc


def _get_float(extra: Mapping[str, Any], key: str) -> float | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {value!r}") from exc


def _one_of(extra: Mapping[str, Any], seed_key: str, own_key: str) -> None:
    if seed_key in extra and own_key in extra:
        raise ConfigError(
            f"kv_connector_extra_config sets both {seed_key!r} (seed name) and {own_key!r} (kvwire name) "
            "for the same setting: keep one"
        )


# --- the mapping -------------------------------------------------------------------------------------


def _check_keys(extra: Mapping[str, Any]) -> None:
    unknown = sorted(set(extra) - SEED_KEYS - KVWIRE_KEYS - LIMIT_KEYS - {PENDING_KEY})
    if unknown:
        raise ConfigError(
            f"KvwireConnector: unknown kv_connector_extra_config key(s) {unknown}. "
            f"Accepted seed (P2pNcclConnector) keys: {sorted(SEED_KEYS)}; "
            f"kvwire keys: {sorted(KVWIRE_KEYS | LIMIT_KEYS | {PENDING_KEY})} (see docs/vllm.md)"
        )


def _role(view: VllmTransferView) -> Role:
    if view.kv_role not in _ROLES:
        raise ConfigError(f"KvwireConnector needs kv_role in {sorted(_ROLES)}, got {view.kv_role!r}")
    return _ROLES[view.kv_role]


def _mode(extra: Mapping[str, Any]) -> TransferMode:
    send_type = _get_str(extra, "send_type")
    seed_mode = None
    if send_type is not None:
        if send_type.upper() not in _SEND_TYPES:
            raise ConfigError(f"send_type must be one of {sorted(_SEND_TYPES)}, got {send_type!r}")
        seed_mode = _SEND_TYPES[send_type.upper()]
    mode_name = _get_str(extra, "mode")
    own_mode = None
    if mode_name is not None:
        try:
            own_mode = TransferMode(mode_name.lower())
        except ValueError as exc:
            raise ConfigError(f"mode must be 'push' or 'pull', got {mode_name!r}") from exc
    if seed_mode is not None and own_mode is not None and seed_mode is not own_mode:
        raise ConfigError(f"send_type {send_type!r} contradicts mode {mode_name!r}")
    return own_mode or seed_mode or TransferMode.PUSH


def _router(extra: Mapping[str, Any]) -> str | None:
    proxy_ip, proxy_port = _get_str(extra, "proxy_ip"), _get_int(extra, "proxy_port")
    routers = extra.get("router")
    if isinstance(routers, (list, tuple)):  # several routers (high availability): each gets every heartbeat
        if not all(isinstance(r, str) and r.startswith(("tcp://", "ipc://")) for r in routers) or not routers:
            raise ConfigError(f"router must be tcp://host:port or a list of them, got {routers!r}")
        return ",".join(routers)
    router = _get_str(extra, "router")
    if (proxy_ip is None) != (proxy_port is None):
        raise ConfigError("proxy_ip and proxy_port go together: set both or neither")
    seed = f"tcp://{proxy_ip}:{proxy_port}" if proxy_ip is not None else None
    if seed is not None and router is not None and seed != router:
        raise ConfigError(f"router {router!r} contradicts proxy_ip/proxy_port ({seed})")
    discovery = _get_str(extra, "discovery")
    if discovery is not None and (router or seed) is not None:
        raise ConfigError(f"discovery {discovery!r} and router/proxy_ip+proxy_port are alternatives: set one")
    address = discovery or router or seed
    if address is not None:
        parse_registration_address(address)  # raises ConfigError naming tcp:// and etcd:// forms
    return address


def _send_delay_fault(extra: Mapping[str, Any]) -> SendDelayFault | None:
    value = extra.get("fault_delay_send")
    if value is None:
        return None
    if not isinstance(value, Mapping) or not set(value) <= {"seconds", "transfer_id_prefix"}:
        raise ConfigError("kv_connector_extra_config.fault_delay_send must be an object "
                          f'{{"seconds": S, "transfer_id_prefix": "..."}}, got {value!r}')
    seconds = _get_float(value, "seconds")
    if seconds is None:
        raise ConfigError("kv_connector_extra_config.fault_delay_send.seconds is required")
    return SendDelayFault(seconds, _get_str(value, "transfer_id_prefix") or "")


def _budgets(extra: Mapping[str, Any]) -> tuple[int, int]:
    _one_of(extra, "kv_buffer_size", "recv_budget_bytes")
    _one_of(extra, "mem_pool_size_gb", "spill_budget_bytes")
    recv = _get_float(extra, "kv_buffer_size")
    if recv is None:
        recv = _get_float(extra, "recv_budget_bytes")
    spill_gb = _get_float(extra, "mem_pool_size_gb")
    spill = spill_gb * GiB if spill_gb is not None else _get_float(extra, "spill_budget_bytes")
    return int(recv if recv is not None else GiB), int(spill if spill is not None else GiB)


def _backend(extra: Mapping[str, Any], device_type: str) -> Backend:
    """The plane for peers on other hosts (``backend``: tcp or nccl; default nccl on CUDA)."""
    name = _get_str(extra, "backend")
    if name is None:
        return Backend.NCCL if device_type == "cuda" else Backend.TCP
    if name.lower() not in (Backend.TCP.value, Backend.NCCL.value):
        raise ConfigError(f"backend must be 'tcp' or 'nccl', got {name!r}")
    return Backend(name.lower())


def _transport(extra: Mapping[str, Any]) -> Transport:
    name = _get_str(extra, "transport")
    if name is None:
        return Transport.AUTO
    try:
        return Transport(name.lower())
    except ValueError as exc:
        choices = "|".join(t.value for t in Transport)
        msg = f"kv_connector_extra_config.transport must be one of {choices}, got {name!r}"
        raise ConfigError(msg) from exc


def _limits(extra: Mapping[str, Any]) -> ControlLimits:
    """The control-plane bounds given (ControlLimits' field names); the others keep their defaults."""
    given: dict[str, Any] = {}
    for field in dataclasses.fields(ControlLimits):
        reader = _get_int if field.type in ("int", int) else _get_float
        value = reader(extra, field.name)
        if value is not None:
            given[field.name] = value
    try:
        return ControlLimits(**given)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from exc


def _pending_transfers(extra: Mapping[str, Any]) -> int:
    value = _get_int(extra, PENDING_KEY)
    return 65536 if value is None else value


def _data_links(extra: Mapping[str, Any]) -> DataLinkConfig:
    """The ``data_*`` link bounds given (the rest keep DataLinkConfig's defaults)."""
    given: dict[str, Any] = {}
    counts = ("max_connections", "max_connections_per_peer", "max_granted_dests_per_peer",
              "max_granted_dests")
    for field in counts:
        value = _get_int(extra, f"data_{field}")
        if value is not None:
            given[field] = value
    for field in ("handshake_timeout_s", "keepalive_s", "link_timeout_s"):
        number = _get_float(extra, f"data_{field}")
        if number is not None:
            given[field] = number
    try:
        return DataLinkConfig(**given)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from exc


def _vllm_failure_policy(view: VllmTransferView) -> LoadFailurePolicy:
    try:
        return LoadFailurePolicy(view.kv_load_failure_policy)
    except ValueError as exc:
        raise ConfigError(f"kv_load_failure_policy {view.kv_load_failure_policy!r} is unknown") from exc


def _connector_config(view: VllmTransferView, extra: Mapping[str, Any]) -> ConnectorConfig:
    deadline_s = _get_float(extra, "deadline_s")
    lease_s = _get_float(extra, "lease_s")
    return ConnectorConfig(
        role=_role(view),
        mode=_mode(extra),
        deadline_s=30.0 if deadline_s is None else deadline_s,
        lease_s=30.0 if lease_s is None else lease_s,
        # The core reports every failed load as invalid blocks (get_block_ids_with_load_errors);
        # vLLM's own kv_load_failure_policy then recomputes or fails the request.
        kv_load_failure_policy=LoadFailurePolicy.RECOMPUTE,
        use_first_token=False,  # vLLM recomputes the last prompt token on D (see 070-vllm-plugin.md)
    )


def _check_transfer_keys(extra: Mapping[str, Any], base_control_port: int, budgets: tuple[int, int],
                         backend: Backend, transport: Transport, device_type: str) -> None:
    """The agent settings refused with the key's own name (before TransferConfig's checks)."""
    if not 0 <= base_control_port <= 65535:
        raise ConfigError(f"kv_port must be in 0..65535, got {base_control_port}")
    for key in ("data_port", "advertise_port", "advertise_data_port"):
        port = _get_int(extra, key) or 0
        if not 0 <= port <= 65535:
            raise ConfigError(f"kv_connector_extra_config.{key} must be in 0..65535, got {port}")
    recv_budget, spill_budget = budgets
    if recv_budget <= 0:
        raise ConfigError(f"kv_buffer_size / recv_budget_bytes must be > 0, got {recv_budget}")
    if spill_budget < 0:
        raise ConfigError(f"mem_pool_size_gb / spill_budget_bytes must be >= 0, got {spill_budget}")
    if backend is Backend.NCCL and device_type != "cuda":
        raise ConfigError("backend 'nccl' needs kv_buffer_device 'cuda'")
    if transport is Transport.SHM and device_type == "cuda":
        raise ConfigError("transport 'shm' moves CPU tensors: kv_buffer_device 'cuda' takes ipc or auto")
    if transport in (Transport.IPC, Transport.NCCL) and device_type != "cuda":
        raise ConfigError(f"transport {transport.value!r} needs kv_buffer_device 'cuda'")


def _transfer_config(view: VllmTransferView, extra: Mapping[str, Any], device_type: str,
                     connector: ConnectorConfig, secret: str | None) -> TransferConfig:
    """Rank 0's transfer agent (fixed ports are the bases of the ranks')."""
    base_control_port = 0 if view.kv_port == VLLM_DEFAULT_KV_PORT else view.kv_port
    budgets = _budgets(extra)
    backend, transport = _backend(extra, device_type), _transport(extra)
    _check_transfer_keys(extra, base_control_port, budgets, backend, transport, device_type)
    pending = _pending_transfers(extra)
    if pending < 1:
        raise ConfigError(f"max_pending_transfers must be >= 1, got {pending}")
    return TransferConfig(
        host=_get_str(extra, "host") or "127.0.0.1",
        control_port=base_control_port,
        data_port=_get_int(extra, "data_port") or 0,
        advertise_host=_get_str(extra, "advertise_host"),
        advertise_control_port=_get_int(extra, "advertise_port") or 0,
        advertise_data_port=_get_int(extra, "advertise_data_port") or 0,
        backend=backend, transport=transport, device=device_type,
        recv_budget_bytes=budgets[0], spill_budget_bytes=budgets[1],
        default_deadline_s=connector.agent_deadline_s,
        secret=secret.encode() if secret else None,
        limits=_limits(extra), max_pending_transfers=pending, links=_data_links(extra),
        nccl=nccl_from_env(),  # the plugin's edge: KVWIRE_NCCL_* read here, once per process
    )


def plugin_config_from_vllm(view: VllmTransferView) -> VllmPluginConfig:
    """Validate and translate; raises :class:`ConfigError` with a message naming the key at fault."""
    extra = view.kv_connector_extra_config
    _check_keys(extra)
    vllm_failure_policy = _vllm_failure_policy(view)
    device_type = "cuda" if view.kv_buffer_device.startswith("cuda") else view.kv_buffer_device
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"kv_buffer_device must be 'cpu' or 'cuda', got {view.kv_buffer_device!r}")
    http_port = _get_int(extra, "http_port")
    http_host = _get_str(extra, "http_host") or _get_str(extra, "host") or "127.0.0.1"
    interval_s = _get_float(extra, "heartbeat_interval_s")
    connector = _connector_config(view, extra)
    secret = _plugin_secret(extra)
    return VllmPluginConfig(
        connector=connector,
        transfer=_transfer_config(view, extra, device_type, connector, secret),
        secret=secret,
        router_address=_router(extra),
        configured_mode=_mode(extra) if {"send_type", "mode"} & set(extra) else None,
        http_url=f"http://{http_host}:{http_port}" if http_port is not None else None,
        heartbeat_interval_s=2.0 if interval_s is None else interval_s,
        instance_id=_get_str(extra, "instance_id") or view.engine_id,
        model_name=_get_str(extra, "model_name"),
        nccl_num_channels=_get_int(extra, "nccl_num_channels"),
        vllm_failure_policy=vllm_failure_policy,
        fault_delay_send=_send_delay_fault(extra),
    )
