"""What ``kvwire up --ray`` places on a Ray cluster: the cluster spec plus where each role may run.

Pure data, no Ray import (the CLI builds and validates it before connecting). A role's
:class:`Placement` is what one instance of it reserves: one placement group of one bundle (so a
tensor-parallel group lands on one node) holding ``tp * cpus_per_rank`` CPUs, ``tp * gpus_per_rank``
GPUs and the role's custom resources, on a node whose labels match the role's. Decision 120.
"""

from __future__ import annotations

import dataclasses
import re

from kvwire.cluster.local import ClusterSpec
from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import Role

RAY_NAMESPACE = "kvwire"  # every kvwire actor lives in this Ray namespace
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
Pairs = tuple[tuple[str, float], ...]
Labels = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Resources one instance reserves (one bundle, one node) and the node labels it needs."""

    tp: int = 1
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    resources: Pairs = ()  # custom resources of the whole instance, e.g. (("pool_p", 1.0),)
    labels: Labels = ()  # node labels that must match, e.g. (("pool", "prefill"),)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ConfigError("cpus and gpus per rank must be >= 0")
        for name, amount in self.resources:
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ConfigError(f"custom resource {name}={amount}: a name other than CPU/GPU/memory, "
                                  "and an amount > 0")

    def bundle(self) -> dict[str, float]:
        """The placement group's one bundle."""
        bundle = {"CPU": self.tp * self.cpus_per_rank, **dict(self.resources)}
        if self.gpus_per_rank:
            bundle["GPU"] = self.tp * self.gpus_per_rank
        return {name: amount for name, amount in bundle.items() if amount > 0} or {"CPU": 0.001}

    def actor_options(self) -> dict[str, float]:
        """``num_cpus`` / ``num_gpus`` of the actor inside that bundle (Ray then sets the actor's
        CUDA_VISIBLE_DEVICES to its GPUs, which the ``kvwire serve`` child inherits)."""
        return {"num_cpus": self.tp * self.cpus_per_rank, "num_gpus": self.tp * self.gpus_per_rank}


@dataclasses.dataclass(frozen=True)
class RaySpec:
    """A kvwire cluster on Ray. ``cluster`` holds what ``kvwire up`` already knows (counts, model,
    modes, deadlines, TP sizes, discovery); ``cluster.host`` and ``spread_gpus`` are not used (each
    process binds its node's IP; Ray assigns GPUs)."""

    cluster: ClusterSpec
    address: str = "auto"  # what ray.init connects to: auto, HOST:PORT or ray://HOST:PORT
    name: str = "default"  # the cluster's name: its controller is the actor kvwire-NAME
    prefill: Placement = Placement()  # also used by colocated (both) instances
    decode: Placement = Placement()
    router: Placement = Placement(cpus_per_rank=1.0)
    max_restarts: int = 20  # per instance actor, by Ray; -1 = without limit
    drain_timeout_s: float = 60.0  # a removed instance's requests in flight may finish for this long

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"cluster name must match {_NAME.pattern}, got {self.name!r}")
        if self.cluster.discovery == "etcd":
            raise ConfigError("on Ray, --discovery takes a running etcd: etcd[+https]://HOST:PORT[/prefix]")
        if self.cluster.spread_gpus:
            raise ConfigError("--spread-gpus does not apply on Ray: each instance gets its GPUs from Ray")
        if self.max_restarts < -1:
            raise ConfigError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if self.drain_timeout_s <= 0:
            raise ConfigError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        for role in (Role.PREFILL, Role.DECODE, Role.BOTH):
            want = self.cluster.decode_tp if role is Role.DECODE else self.cluster.prefill_tp
            if self.placement(role).tp != want:
                raise ConfigError(f"{role.value} placement tp {self.placement(role).tp} != {want}")

    @property
    def controller_name(self) -> str:
        return f"kvwire-{self.name}"

    def placement(self, role: Role) -> Placement:
        return self.decode if role is Role.DECODE else self.prefill

    def actor_name(self, instance: str) -> str:
        return f"kvwire-{self.name}-{instance}"


def parse_resources(text: str | None) -> Pairs:
    """``NAME=AMOUNT[,NAME=AMOUNT...]`` -> pairs (an empty or missing text: none)."""
    pairs: list[tuple[str, float]] = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, sep, amount = item.partition("=")
        try:
            value = float(amount) if sep else 1.0
        except ValueError:
            raise ConfigError(f"resource {item!r}: the amount must be a number (NAME=AMOUNT)") from None
        pairs.append((name.strip(), value))
    return tuple(pairs)


def parse_labels(text: str | None) -> Labels:
    """``KEY=VALUE[,KEY=VALUE...]`` -> pairs."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"label {item!r}: expected KEY=VALUE")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)
