"""LocalCluster: a router and prefill/decode (or colocated) instances as subprocesses on loopback.

Used by ``kvwire up``, ``kvwire demo``, the end-to-end tests and ``kvwire bench serve`` setups.
Start order: router, then instances (``--instance-id`` = their name, HTTP and KV ports picked by
the OS); ready = every instance registered alive with the router and answering ``/health``, within
``start_timeout_s``. Stop order: instances (they deregister), then the router; each is SIGTERMed and
SIGKILLed after ``stop_grace_s``. With ``discovery="etcd"`` a local etcd starts first (the ``etcd``
binary must be installed) and stops last; instances register there and the router watches it;
``discovery="etcd://HOST:PORT[/prefix]"`` uses an etcd that is already running. An instance that
exits because its engine lost a tensor-parallel rank is restarted under its name by
:meth:`LocalCluster.restart_if_rank_lost` (``kvwire up`` calls it; decision 085).

Modes, roles and policies are enums (:class:`~kvwire.protocol.kv_params.TransferMode`,
:class:`~kvwire.discovery.heartbeats.Role`, :class:`~kvwire.protocol.kv_params.LoadFailurePolicy`);
where one is given, its string value (what the CLI and tests spell) is accepted too and converted at
construction; anything else is a :class:`~kvwire.errors.ConfigError` naming the valid values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any, TextIO

from kvwire.cluster.process import ManagedProcess, kvwire_argv
from kvwire.discovery.address import DiscoveryKind, parse_discovery_address
from kvwire.enum_values import as_enum
from kvwire.errors import EXIT_RANK_LOST, ClusterError, ConfigError
from kvwire.protocol.kv_params import LoadFailurePolicy, Role, TransferMode
from kvwire.transfer.enums import Transport

log = logging.getLogger(__name__)
MAX_RANK_LOST_RESTARTS = 3  # per instance name: a rank that keeps dying is a fault to look at
GPU_SHARE = 0.9  # of a GPU's memory, split between the instances `kvwire up` puts on it


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0  # colocated instances (the baseline)
    model: str = "tiny"
    device: str = "cpu"
    mode: TransferMode = TransferMode.PUSH
    host: str = "127.0.0.1"
    port: int = 0  # the router's HTTP port; 0 = any free port
    kv_deadline_s: float = 30.0
    kv_transport: Transport = Transport.AUTO  # KV data plane of every instance (auto: negotiated)
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE  # of decode instances
    heartbeat_interval_s: float = 1.0
    instance_ttl_s: float = 2.5  # 2.5 heartbeat intervals, as the router's default (decision 109)
    start_timeout_s: float = 180.0
    stop_grace_s: float = 10.0
    serve_args: tuple[str, ...] = ()  # extra ``kvwire serve`` flags for every instance
    # > 0: instance k (in start order) sees only GPU ``k % spread_gpus`` (CUDA_VISIBLE_DEVICES), so a
    # 1P1D cluster on a 2-GPU host puts P and D on different GPUs (NCCL needs distinct devices).
    spread_gpus: int = 0
    router_args: tuple[str, ...] = ()  # extra ``kvwire router`` flags
    # Given to every process through the environment (never on a command line, where `ps` shows it):
    # the API key clients send to the router, which it also sends to the instances (KVWIRE_API_KEY,
    # KVWIRE_INSTANCE_API_KEY), and the shared secret (KVWIRE_SECRET). None: inherited as they are
    # (a KVWIRE_API_KEY in our environment is then the cluster's key, used the same way).
    api_key: str | None = None
    secret: str | None = dataclasses.field(default=None, repr=False)  # never in a repr or log
    prefill_tp: int = 1  # tensor-parallel size of each prefill instance (and of colocated ones)
    decode_tp: int = 1  # tensor-parallel size of each decode instance
    # "zmq": the router's embedded heartbeats; "etcd": start a local etcd; "etcd://...": use that etcd.
    discovery: str = "zmq"

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_both) < 0:
            raise ConfigError("instance counts must be >= 0")
        # parse_discovery_address raises ConfigError naming the accepted forms
        if self.discovery not in ("zmq", "etcd") and (
            parse_discovery_address(self.discovery).kind is not DiscoveryKind.ETCD
        ):
            raise ConfigError(f"discovery must be zmq, etcd or etcd[+https]://HOST:PORT[/prefix], "
                              f"got {self.discovery!r}")
        if self.num_prefill + self.num_decode + self.num_both == 0:
            raise ConfigError("a cluster needs at least one instance")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ConfigError("P/D needs at least one prefill and one decode instance (or neither)")
        # Frozen: the converted members are stored with object.__setattr__ (dataclasses' own way).
        object.__setattr__(self, "mode", as_enum(TransferMode, self.mode, "mode"))
        object.__setattr__(self, "kv_transport", as_enum(Transport, self.kv_transport, "kv_transport"))
        policy = as_enum(LoadFailurePolicy, self.kv_load_failure_policy, "kv_load_failure_policy")
        object.__setattr__(self, "kv_load_failure_policy", policy)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.spread_gpus < 0:
            raise ConfigError("spread_gpus must be >= 0")
        if min(self.prefill_tp, self.decode_tp) < 1:
            raise ConfigError("prefill_tp and decode_tp must be >= 1")
        positive = ("kv_deadline_s", "heartbeat_interval_s", "instance_ttl_s", "start_timeout_s",
                    "stop_grace_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")


@dataclasses.dataclass
class Instance:
    name: str  # also its --instance-id
    role: Role
    process: ManagedProcess
    url: str | None = None  # known once registered


def free_port(host: str) -> int:
    """A port the OS considers free now (a small race with other binders is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def http_text(url: str, timeout_s: float = 2.0, api_key: str | None = None) -> str:
    """GET ``url`` (with ``Authorization: Bearer api_key`` when given) as text; raises OSError on
    failure."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
        return str(resp.read().decode())


def http_json(url: str, timeout_s: float = 2.0, api_key: str | None = None) -> Any:
    """:func:`http_text`, decoded as JSON; raises OSError/ValueError on failure."""
    return json.loads(http_text(url, timeout_s, api_key))


class LocalCluster:
    """See the module docstring. Context manager; :meth:`stop` is idempotent."""

    def __init__(self, spec: ClusterSpec, *, sink: TextIO | None = None) -> None:
        self.spec = spec
        self._sink = sink if sink is not None else sys.stdout
        self._sink_lock = threading.Lock()
        self.router: ManagedProcess | None = None
        self.instances: dict[str, Instance] = {}
        self.router_url = ""
        self.discovery_address = ""
        self.etcd: Any = None  # kvwire.cluster.etcd.LocalEtcd when spec.discovery == "etcd"
        self._stopped = False
        self._restarts: dict[str, int] = {}  # instance name -> restarts after a lost rank
        self._router_argv: list[str] = []
        self.api_key = spec.api_key or os.environ.get("KVWIRE_API_KEY") or None

    # --- start ----------------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Start everything and wait until ready; on any failure stop what started and raise
        :class:`ClusterError`."""
        try:
            self.start_router()
            spec = self.spec
            roles = [(Role.PREFILL, spec.num_prefill), (Role.DECODE, spec.num_decode),
                     (Role.BOTH, spec.num_both)]
            shared = self._shares_a_gpu()
            for role, count in roles:
                for index in range(count):
                    self.start_instance(f"{role.value}-{index}", role)
                    if shared:  # each sizes its KV cache from the memory still free: one at a time
                        self.wait_ready()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _shares_a_gpu(self) -> bool:
        """Several instances on one CUDA device (no --spread-gpus, or fewer GPUs than instances)."""
        spec = self.spec
        count = spec.num_prefill + spec.num_decode + spec.num_both
        apart = 0 < spec.spread_gpus >= count
        return spec.device.startswith("cuda") and count > 1 and not apart

    def _gpu_share_args(self) -> tuple[str, ...]:
        """``--gpu-memory-utilization`` for instances that share a GPU: 0.9 of it split evenly, so the
        first one started does not size its KV cache into the others' weights (the spec's serve
        flags, after these, override it)."""
        if not self._shares_a_gpu():
            return ()
        spec = self.spec
        count = spec.num_prefill + spec.num_decode + spec.num_both
        per_gpu = count if spec.spread_gpus == 0 else -(-count // spec.spread_gpus)
        return ("--gpu-memory-utilization", f"{GPU_SHARE / per_gpu:.4f}")

    def start_router(self) -> None:
        """Start the router alone (:meth:`start` does it first; tests that start their own
        instances with :meth:`start_instance` call it, then :meth:`wait_ready`)."""
        spec = self.spec
        port = spec.port or free_port(spec.host)
        discovery_port = free_port(spec.host)
        self.router_url = f"http://{spec.host}:{port}"
        self.discovery_address = f"tcp://{spec.host}:{discovery_port}"
        watch: tuple[str, ...] = ()
        if spec.discovery != "zmq":
            self.discovery_address = self._etcd_address()
            watch = ("--discovery", self.discovery_address)
        argv = kvwire_argv(
            "router", "--host", spec.host, "--port", str(port), "--discovery-host", spec.host,
            "--discovery-port", str(discovery_port), "--mode", spec.mode.value, *watch,
            "--kv-deadline-s", str(spec.kv_deadline_s), "--instance-ttl-s", str(spec.instance_ttl_s),
            *spec.router_args,
        )
        env = self._env(KVWIRE_INSTANCE_API_KEY=self.api_key)
        self._router_argv = argv
        self.router = ManagedProcess("router", argv, sink=self._sink, sink_lock=self._sink_lock, env=env)

    def restart_router(self) -> None:
        """Stop the router and start a new one on the same HTTP and discovery ports (its state, the
        KV index included, starts empty); returns once every running instance is registered again."""
        if self.router is None:
            raise ClusterError("the router was never started")
        self.router.stop(self.spec.stop_grace_s)
        env = self._env(KVWIRE_INSTANCE_API_KEY=self.api_key)
        self.router = ManagedProcess("router", self._router_argv, sink=self._sink, sink_lock=self._sink_lock,
                                     env=env)
        self.wait_ready()

    def _env(self, **extra: str | None) -> dict[str, str] | None:
        """The children's environment: ours plus the spec's credentials (None: ours unchanged)."""
        spec = self.spec
        values = {"KVWIRE_API_KEY": self.api_key, "KVWIRE_SECRET": spec.secret, **extra}
        given = {name: value for name, value in values.items() if value is not None}
        return dict(os.environ, **given) if given else None

    def _etcd_address(self) -> str:
        if self.spec.discovery != "etcd":
            return self.spec.discovery
        from kvwire.cluster.etcd import EtcdStartError, EtcdUnavailable, LocalEtcd

        try:
            self.etcd = LocalEtcd(self.spec.host, sink=self._sink).start()
        except (EtcdUnavailable, EtcdStartError) as exc:
            raise ClusterError(f"--discovery etcd: {exc}") from exc
        address: str = self.etcd.discovery
        return address

    def start_instance(self, name: str, role: Role, extra_args: tuple[str, ...] = ()) -> Instance:
        """Start one more instance (also used to restart a killed one under a new name). ``role`` may
        be given by value (``"prefill"``); an unknown one raises :class:`ConfigError`, starting nothing.
        ``extra_args``: ``kvwire serve`` flags of this instance alone (after the spec's)."""
        role = as_enum(Role, role, "role")
        spec = self.spec
        argv = kvwire_argv(
            "serve", "--model", spec.model, "--device", spec.device, "--host", spec.host, "--port", "0",
            "--role", role.value, "--router", self.discovery_address, "--instance-id", name,
            "--heartbeat-interval-s", str(spec.heartbeat_interval_s), "--kv-mode", spec.mode.value,
            "--kv-deadline-s", str(spec.kv_deadline_s), "--kv-transport", spec.kv_transport.value,
            "--kv-load-failure-policy", spec.kv_load_failure_policy.value,
            "--tensor-parallel-size", str(spec.decode_tp if role is Role.DECODE else spec.prefill_tp),
            *self._gpu_share_args(), *spec.serve_args, *extra_args,
        )
        env = self._env()
        if spec.spread_gpus > 0:
            env = dict(env or os.environ, CUDA_VISIBLE_DEVICES=str(len(self.instances) % spec.spread_gpus))
        process = ManagedProcess(name, argv, sink=self._sink, sink_lock=self._sink_lock, env=env)
        instance = Instance(name, role, process)
        self.instances[name] = instance
        return instance

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until every running instance is registered alive and healthy (raises ClusterError)."""
        deadline = time.monotonic() + (self.spec.start_timeout_s if timeout_s is None else timeout_s)
        while True:
            self._check_alive()
            if self._all_registered() and all(self._healthy(i) for i in self.live_instances()):
                return
            if time.monotonic() >= deadline:
                raise ClusterError(f"cluster not ready within the deadline; pending: {self._pending()}")
            time.sleep(0.2)

    def _check_alive(self) -> None:
        exited = self._exited_unexpectedly()
        if exited is not None:
            name, proc = exited
            tail = "\n".join(proc.lines[-20:])
            raise ClusterError(f"{name} exited with code {proc.poll()} during start-up:\n{tail}")

    def _all_registered(self) -> bool:
        try:
            listed = http_json(f"{self.router_url}/instances", api_key=self.api_key)
        except (OSError, ValueError):
            return False
        alive = {entry["id"]: entry["url"] for entry in listed if entry.get("alive")}
        for instance in self.live_instances():
            if instance.name not in alive:
                return False
            instance.url = alive[instance.name]
        return True

    def _healthy(self, instance: Instance) -> bool:
        if instance.url is None:
            return False
        try:
            http_json(f"{instance.url}/health")
        except (OSError, ValueError):
            return False
        return True

    def _pending(self) -> list[str]:
        return [i.name for i in self.live_instances() if i.url is None or not self._healthy(i)]

    def live_instances(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.process.poll() is None]

    # --- run ------------------------------------------------------------------------------------

    def check(self) -> str | None:
        """Name of the first process that exited unexpectedly, or None."""
        exited = self._exited_unexpectedly()
        return None if exited is None else exited[0]

    def _exited_unexpectedly(self) -> tuple[str, ManagedProcess] | None:
        procs = [("router", self.router)] + [(i.name, i.process) for i in self.instances.values()]
        for name, proc in procs:
            if proc is not None and proc.poll() is not None and not proc.expected_exit:
                return name, proc
        return None

    def restart_if_rank_lost(self, name: str) -> bool:
        """Restart instance ``name`` under the same name if it exited because its engine lost a
        tensor-parallel rank (exit code EXIT_RANK_LOST, decision 085), at most
        ``MAX_RANK_LOST_RESTARTS`` times per name; True if restarted. It registers when ready."""
        instance = self.instances.get(name)
        if instance is None or instance.process.poll() != EXIT_RANK_LOST:
            return False
        if self._restarts.get(name, 0) >= MAX_RANK_LOST_RESTARTS:
            return False
        self._restarts[name] = self._restarts.get(name, 0) + 1
        log.warning("%s lost a tensor-parallel rank (exit %d): restarting it", name, EXIT_RANK_LOST)
        self.start_instance(name, instance.role)
        return True

    def kill(self, name: str, sig: int) -> None:
        """Send ``sig`` to an instance's process group (fault injection); its exit is expected."""
        process = self.instances[name].process
        process.expected_exit = True
        process.signal(sig)

    # --- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop instances (in parallel), then the router; no process outlives this call."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.spec.stop_grace_s
        threads = [
            threading.Thread(target=i.process.stop, args=(grace,), daemon=True)
            for i in self.instances.values()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=3 * grace)
        if self.router is not None:
            self.router.stop(grace)
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
