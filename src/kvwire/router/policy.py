"""Routing policies: pure functions that pick one instance from a snapshot.

A policy is ``(candidates, ctx) -> Candidate``. ``candidates`` is a non-empty sequence sorted by
instance id (the registry's order) combined with the router's own in-flight counts; ``ctx`` carries
the caller-held state (a per-role turn counter, a random generator). Policies keep no state of their
own, so they are trivially testable; P and D are picked by separate calls with separate turns.
To add a policy: write the function and list it in :data:`POLICIES`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvwire.discovery.messages import InstanceLoad
from kvwire.router.config import Policy


@dataclass(frozen=True)
class Candidate:
    instance_id: str
    url: str
    load: InstanceLoad | None = None  # as last reported by the instance (up to one interval old)
    inflight_requests: int = 0  # tracked by this router: sent, not finished
    inflight_tokens: int = 0  # tracked by this router: estimated prompt + max new tokens in flight


@dataclass
class PickContext:
    turn: int  # per-role counter, incremented by the caller after each pick
    rng: random.Random


PolicyFn = Callable[[Sequence[Candidate], PickContext], Candidate]


def round_robin(candidates: Sequence[Candidate], ctx: PickContext) -> Candidate:
    return candidates[ctx.turn % len(candidates)]


def random_choice(candidates: Sequence[Candidate], ctx: PickContext) -> Candidate:
    return candidates[ctx.rng.randrange(len(candidates))]


def load_key(c: Candidate) -> tuple[int, int, float]:
    """Smaller is less loaded.

    Requests: the larger of what this router has in flight there and what the instance reported
    (the report also counts other routers' traffic but lags by up to one heartbeat). Then tokens in
    flight, then the fraction of KV blocks in use.
    """
    reported = c.load.num_requests if c.load is not None else 0
    kv_used = 1.0 - c.load.free_kv_fraction if c.load is not None else 0.0
    return (max(c.inflight_requests, reported), c.inflight_tokens, kv_used)


def least_loaded(candidates: Sequence[Candidate], ctx: PickContext) -> Candidate:
    # Start the scan at the turn so that ties rotate instead of always landing on the first one.
    n = len(candidates)
    start = ctx.turn % n
    best = candidates[start]
    best_key = load_key(best)
    for i in range(1, n):
        cand = candidates[(start + i) % n]
        key = load_key(cand)
        if key < best_key:
            best, best_key = cand, key
    return best


POLICIES: dict[Policy, PolicyFn] = {
    Policy.ROUND_ROBIN: round_robin,
    Policy.LEAST_LOADED: least_loaded,
    Policy.RANDOM: random_choice,
}
