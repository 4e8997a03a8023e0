"""The controller of a kvwire cluster on Ray: places, scales and stops the router and instances.

One named actor per cluster (``kvwire-NAME`` in namespace ``kvwire``), created by ``kvwire up --ray``
or :class:`~kvwire.cluster.ray_cluster.RayCluster`. It owns every other actor of the cluster and each
instance's placement group, so Ray ends them all when it ends (their owner), and when the driver that
created it ends. ``kvwire scale`` finds it by name. Decision 120.

Placement: the router first (its ports picked by a task inside its placement group, i.e. on its node,
and passed as arguments, so a restarted router binds the same ones); then each instance in a
placement group of one bundle (:meth:`~kvwire.cluster.ray_spec.Placement.bundle`), hosted by a
:class:`~kvwire.cluster.ray_actors.ProcessHost` that Ray restarts up to ``max_restarts`` times.
Instance ids are ``ROLE-K`` (K never reused); an instance keeps its id across restarts, not its ports
(port 0: the OS picks; the new registration tells the router). Ready = every instance registered
alive with the router and answering ``/health``. Scale-down drains (SIGUSR1: deregister, finish in
flight) the newest instances of the role, then ends their actors and placement groups.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvwire.cluster.local import http_json
from kvwire.cluster.process import kvwire_argv
from kvwire.cluster.ray_actors import ProcessHost, free_ports
from kvwire.cluster.ray_spec import RAY_NAMESPACE, Placement, RaySpec
from kvwire.enum_values import as_enum
from kvwire.errors import ClusterError, ConfigError
from kvwire.protocol.kv_params import Role

log = logging.getLogger(__name__)
ROUTER = "router"
_Host = ray.remote(ProcessHost)
_free_ports = ray.remote(free_ports)


@dataclasses.dataclass
class Member:
    name: str
    role: Role | None  # None: the router
    actor: Any  # ray ActorHandle of a ProcessHost
    group: PlacementGroup


class ClusterController:
    """See the module docstring. Runs as a Ray actor; every method is called through Ray, one at a
    time. ``env``: the credentials given to every process (KVWIRE_API_KEY, KVWIRE_SECRET, ...)."""

    def __init__(self, spec: RaySpec, env: dict[str, str]) -> None:
        self.spec = spec
        self._env = env
        self._api_key = env.get("KVWIRE_API_KEY") or None
        self.members: dict[str, Member] = {}
        self._next_index = {role: 0 for role in Role}
        self.router_url = ""
        self._discovery = ""

    # --- start ----------------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Router, then the spec's instances; returns :meth:`status` once ready (ClusterError else,
        after stopping what started)."""
        try:
            self._start_router()
            spec = self.spec.cluster
            for role, count in ((Role.PREFILL, spec.num_prefill), (Role.DECODE, spec.num_decode),
                                (Role.BOTH, spec.num_both)):
                for _ in range(count):
                    self._start_instance(role)
            self._wait_ready(list(self.instances()))
        except BaseException:
            self.stop()
            raise
        return self.status()

    def _group(self, placement: Placement, what: str) -> PlacementGroup:
        labels = [dict(placement.labels)] if placement.labels else None
        group = placement_group([placement.bundle()], strategy="STRICT_PACK", bundle_label_selector=labels)
        timeout_s = self.spec.cluster.start_timeout_s
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(group)
            raise ClusterError(f"{what}: no node offered {placement.bundle()} with labels "
                               f"{dict(placement.labels)} within {timeout_s:.0f} s")
        return group

    def _strategy(self, group: PlacementGroup) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)

    def _start_router(self) -> None:
        spec, placement = self.spec.cluster, self.spec.router
        group = self._group(placement, ROUTER)
        ip, (picked_http, discovery_port) = ray.get(
            _free_ports.options(num_cpus=0, scheduling_strategy=self._strategy(group)).remote(2))
        port = spec.port or picked_http
        self.router_url = f"http://{ip}:{port}"
        self._discovery = f"tcp://{ip}:{discovery_port}" if spec.discovery == "zmq" else spec.discovery
        argv = self.router_argv(port, discovery_port)
        env = dict(self._env)
        if self._api_key:
            env["KVWIRE_INSTANCE_API_KEY"] = self._api_key
        actor = _Host.options(
            name=self.spec.actor_name(ROUTER), namespace=RAY_NAMESPACE, max_restarts=self.spec.max_restarts,
            scheduling_strategy=self._strategy(group), **placement.actor_options(),
        ).remote(ROUTER, argv, ("--host", "--discovery-host"), env)
        self.members[ROUTER] = Member(ROUTER, None, actor, group)

    def router_argv(self, port: int, discovery_port: int) -> list[str]:
        """``kvwire router`` (its node's IP is appended as ``--host`` and ``--discovery-host``)."""
        spec = self.spec.cluster
        watch = ("--discovery", spec.discovery) if spec.discovery != "zmq" else ()
        return kvwire_argv(
            "router", "--port", str(port), "--discovery-port", str(discovery_port), "--mode", spec.mode.value,
            *watch, "--kv-deadline-s", str(spec.kv_deadline_s), "--instance-ttl-s", str(spec.instance_ttl_s),
            *spec.router_args,
        )

    def serve_argv(self, name: str, role: Role) -> list[str]:
        """``kvwire serve`` of instance ``name`` (its node's IP is appended as ``--host``)."""
        spec = self.spec.cluster
        return kvwire_argv(
            "serve", "--model", spec.model, "--device", spec.device, "--port", "0", "--role", role.value,
            "--router", self._discovery, "--instance-id", name,
            "--heartbeat-interval-s", str(spec.heartbeat_interval_s), "--kv-mode", spec.mode.value,
            "--kv-deadline-s", str(spec.kv_deadline_s), "--kv-transport", spec.kv_transport.value,
            "--kv-load-failure-policy", spec.kv_load_failure_policy.value,
            "--tensor-parallel-size", str(self.spec.placement(role).tp),
            "--drain-timeout-s", str(self.spec.drain_timeout_s), *spec.serve_args,
        )

    def _start_instance(self, role: Role) -> str:
        name = f"{role.value}-{self._next_index[role]}"
        self._next_index[role] += 1
        placement = self.spec.placement(role)
        group = self._group(placement, name)
        actor = _Host.options(
            name=self.spec.actor_name(name), namespace=RAY_NAMESPACE, max_restarts=self.spec.max_restarts,
            scheduling_strategy=self._strategy(group), **placement.actor_options(),
        ).remote(name, self.serve_argv(name, role), ("--host",), dict(self._env))
        self.members[name] = Member(name, role, actor, group)
        return name

    def instances(self) -> dict[str, Member]:
        return {name: m for name, m in self.members.items() if m.role is not None}

    # --- readiness ------------------------------------------------------------------------------

    def registered(self) -> dict[str, str]:
        """Instance id -> URL of every instance the router lists alive ({} when it does not answer)."""
        try:
            listed = http_json(f"{self.router_url}/instances", api_key=self._api_key)
        except (OSError, ValueError):
            return {}
        return {str(e["id"]): str(e["url"]) for e in listed if isinstance(e, dict) and e.get("alive")}

    def _wait_ready(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.spec.cluster.start_timeout_s
        while True:
            alive = self.registered()
            pending = [n for n in names if n not in alive or not _healthy(alive[n])]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise ClusterError(f"not ready within {self.spec.cluster.start_timeout_s:.0f} s: {pending}")
            time.sleep(0.2)

    # --- run ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Router URL and, per process, its role, node, pids and whether Ray restarted it (a process
        Ray is restarting shows ``alive: False``)."""
        refs = {name: m.actor.info.remote() for name, m in self.members.items()}
        processes: dict[str, Any] = {}
        for name, ref in refs.items():
            role = self.members[name].role
            try:
                info = ray.get(ref, timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                info = {"alive": False, "error": type(exc).__name__}
            processes[name] = {**info, "role": role.value if role is not None else ROUTER}
        return {"router_url": self.router_url, "discovery": self._discovery, "processes": processes}

    def scale(self, role: str | Role, count: int) -> dict[str, Any]:
        """Start or drain instances of ``role`` until it has ``count``; returns :meth:`status`."""
        role = as_enum(Role, role, "role")
        if count < 0:
            raise ConfigError(f"count must be >= 0, got {count}")
        current = sorted((m for m in self.instances().values() if m.role is role),
                         key=lambda m: int(m.name.rsplit("-", 1)[1]))
        if count > len(current):
            started: list[str] = []
            try:
                for _ in range(count - len(current)):
                    started.append(self._start_instance(role))
                self._wait_ready(started)
            except BaseException:  # not placed or not ready in time: take back what was started
                for name in started:
                    self.members[name].actor.stop.remote(self.spec.cluster.stop_grace_s)
                    self._end(self.members.pop(name))
                raise
        elif count < len(current):
            self._drain([m.name for m in current[count:]])
        return self.status()

    def _drain(self, names: list[str]) -> None:
        """Drain ``names`` in parallel (each finishes its requests in flight), then end them."""
        grace = self.spec.cluster.stop_grace_s
        refs = [self.members[n].actor.drain.remote(self.spec.drain_timeout_s, grace) for n in names]
        try:
            ray.get(refs, timeout=self.spec.drain_timeout_s + 3 * grace + 30)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("draining %s: %s (ending them anyway)", names, exc)
        for name in names:
            self._end(self.members.pop(name))

    def _end(self, member: Member) -> None:
        ray.kill(member.actor, no_restart=True)
        remove_placement_group(member.group)

    # --- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every instance (SIGTERM, in parallel: each deregisters), then the router; end their
        actors and placement groups. Idempotent."""
        grace = self.spec.cluster.stop_grace_s
        for group in (list(self.instances()), [ROUTER] if ROUTER in self.members else []):
            refs = [self.members[name].actor.stop.remote(grace) for name in group]
            try:
                ray.get(refs, timeout=3 * grace + 30)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("stopping %s: %s (ending them anyway)", group, exc)
            for name in group:
                self._end(self.members.pop(name))


def _healthy(url: str) -> bool:
    try:
        http_json(f"{url}/health")
    except (OSError, ValueError):
        return False
    return True
