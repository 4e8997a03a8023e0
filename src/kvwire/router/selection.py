"""Choosing instances for one request: the dispatch plan, policy picks, in-flight accounting.

Runs on the router's event loop only (no locks): the registry is read through its immutable snapshots.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvwire.discovery.messages import InstanceRole
from kvwire.errors import NoInstanceError, RouterError
from kvwire.router.config import Policy
from kvwire.router.policy import POLICIES, Candidate, PickContext
from kvwire.router.registry import InstanceView, Registry


class Plan(str, enum.Enum):
    COLOCATED = "colocated"  # one `both` instance serves the whole request
    DISAGGREGATED = "pd"  # prefill on a `prefill` instance, decode on a `decode` instance


# least_loaded and random look at a random sample of this many live instances when there are more
# (the "power of d choices": near the true least loaded, at a cost that does not grow with N).
# round_robin always walks them all.
SAMPLE_SIZE = 32


class ModelNotFoundError(RouterError):
    """No instance, alive or not, serves the requested model (becomes HTTP 404)."""


class Selector:
    def __init__(self, registry: Registry, policy: Policy, seed: int | None = None) -> None:
        self._registry = registry
        self._policy = POLICIES[policy]
        self._sampled = policy in (Policy.LEAST_LOADED, Policy.RANDOM)
        self._ctx = {role: PickContext(turn=0, rng=random.Random(seed)) for role in InstanceRole}
        self._inflight: dict[str, list[int]] = {}  # instance id -> [requests, tokens]

    def _live(self, role: InstanceRole, model: str | None) -> Sequence[InstanceView]:
        return self._registry.live(role, model)  # the registry's cached tuple: no copy

    def _has_live(self, role: InstanceRole, model: str | None) -> bool:
        return bool(self._registry.live(role, model))

    def plan(self, model: str | None) -> Plan:
        """P/D when a prefill and a decode instance are live, else colocated; raises if neither."""
        has_p = self._has_live(InstanceRole.PREFILL, model)
        has_d = self._has_live(InstanceRole.DECODE, model)
        if has_p and has_d:
            return Plan.DISAGGREGATED
        if self._has_live(InstanceRole.BOTH, model):
            return Plan.COLOCATED
        self._check_model(model)
        for_model = f" for model {model!r}" if model else ""
        if has_p:
            raise NoInstanceError(f"no live decode instance{for_model} (prefill instances are up)")
        if has_d:
            raise NoInstanceError(f"no live prefill instance{for_model} (decode instances are up)")
        raise NoInstanceError(f"no live instance{for_model}")

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = {v.info.model for v in self._registry.snapshot()}
        if known and model not in known:
            raise ModelNotFoundError(f"model {model!r} not found; served: {sorted(known)}")

    def pick(self, role: InstanceRole, model: str | None) -> InstanceView:
        """Pick a live instance of ``role`` by the policy; P and D keep separate turns."""
        views = self._live(role, model)
        if not views:
            raise NoInstanceError(f"no live {role.value} instance")
        ctx = self._ctx[role]
        if self._sampled and len(views) > SAMPLE_SIZE:
            views = [views[i] for i in sorted(ctx.rng.sample(range(len(views)), SAMPLE_SIZE))]
        candidates = [self._candidate(v) for v in views]
        chosen = self._policy(candidates, ctx)
        ctx.turn += 1
        return views[next(i for i, c in enumerate(candidates) if c is chosen)]

    def _candidate(self, view: InstanceView) -> Candidate:
        requests, tokens = self._inflight.get(view.instance_id, (0, 0))
        return Candidate(view.instance_id, view.url, view.load, requests, tokens)

    @contextmanager
    def track(self, instance_id: str, num_tokens: int) -> Iterator[None]:
        """Count one request of ``num_tokens`` in flight on ``instance_id`` for the block's duration."""
        entry = self._inflight.setdefault(instance_id, [0, 0])
        entry[0] += 1
        entry[1] += num_tokens
        try:
            yield
        finally:
            entry[0] -= 1
            entry[1] -= num_tokens
            if entry[0] <= 0:
                self._inflight.pop(instance_id, None)

    def inflight(self, instance_id: str) -> tuple[int, int]:
        requests, tokens = self._inflight.get(instance_id, (0, 0))
        return requests, tokens
