"""Routing policies: pure functions that pick one instance from a snapshot.

A policy is ``(candidates, ctx) -> Candidate``. ``candidates`` is a non-empty sequence sorted by
instance id (the registry's order) combined with the router's own in-flight counts; ``ctx`` carries
the caller-held state (a per-role turn counter, a random generator). Policies keep no state of their
own, so they are trivially testable; P and D are picked by separate calls with separate turns.
To add a policy: write the function and list it in :data:`POLICIES`.

``kv_aware`` (decision 045) also reads, per candidate, the prompt tokens it already holds in its
prefix cache (``cached_tokens``, from the router's KV index) and, in the context, the request's
prompt length and the role being picked.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvwire.discovery.heartbeats import InstanceLoad
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy


@dataclass(frozen=True, slots=True)
class Candidate:
    instance_id: str
    url: str
    load: InstanceLoad | None = None  # as last reported by the instance (up to one interval old)
    inflight_requests: int = 0  # tracked by this router: sent, not finished
    inflight_tokens: int = 0  # tracked by this router: prompt tokens to compute + new tokens in flight
    cached_tokens: int = 0  # leading prompt tokens of this request the instance holds (KV index)
    # :func:`load_key` of this candidate, computed once here: the selector reuses a candidate
    # across picks while its instance's report and in-flight counts stay the same
    key: tuple[int, int, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", load_key(self))


@dataclass
class PickContext:
    turn: int  # per-role counter, incremented by the caller after each pick
    rng: random.Random
    role: Role = Role.BOTH  # the role being picked
    prompt_tokens: int = 0  # the request's prompt length (tokenized), 0 when unknown
    # kv_aware: prompt tokens every candidate gets without holding them itself (for D: what the best
    # prefill instance holds, less the hand-over; decision 101); a candidate's cache term is at least this
    floor_tokens: int = 0
    # kv_aware: ties broken so far (the next tie goes to the next tied candidate); advanced by the
    # policy, like ``rng``, because only picks that tie may advance it (decision 101)
    ties: int = 0


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
    """The candidate with the smallest :func:`load_key`. The scan starts at the turn, so that ties
    rotate instead of always landing on the first one."""
    n = len(candidates)
    start = ctx.turn % n
    best = candidates[start]
    best_key = best.key
    for cand in candidates[start + 1:]:
        if cand.key < best_key:
            best, best_key = cand, cand.key
    for cand in candidates[:start]:
        if cand.key < best_key:
            best, best_key = cand, cand.key
    return best


@dataclass(frozen=True)
class KvAwareWeights:
    """Load terms of :func:`kv_aware`, in prompt tokens (the unit of the cache term)."""

    request_tokens: float = 32.0  # per request running or waiting (P: a prefill's fixed cost)
    decode_request_tokens: float = 64.0  # per request on D (one more sequence in every decode step)
    kv_full_tokens: float = 256.0  # an instance whose KV cache is full, scaled by the fraction used
    # D: what going through P (P call, transfer, hand-over) costs over D prefilling from its own
    # cache; a D lacking a prefix that a P holds scores that prefix less this (decision 101). 256:
    # a D holding a shared prompt keeps it while it runs at most one other request (its load term
    # is then ~200 tokens), and a conversation keeps its D unless that D is far busier.
    handover_tokens: float = 256.0


KV_AWARE_WEIGHTS = KvAwareWeights()


def kv_aware_score(c: Candidate, ctx: PickContext, w: KvAwareWeights = KV_AWARE_WEIGHTS) -> float:
    """Cached prefix tokens minus load. Larger is better.

    The cache term is at least ``ctx.floor_tokens``: on D, a prefix that some P holds is worth to a
    D lacking it what P's path saves (P's cached tokens less the hand-over), so a D holding a shared
    prefix wins only while it is not busier than that difference (decision 101).

    Load: the tokens this router has in flight there (P: prompt tokens still to compute; D: prompt
    plus new tokens), the requests it has in flight there, and how full the instance reported its KV
    cache. Unlike :func:`load_key` the reported request count is not used: it lags by up to one
    heartbeat, and after a burst a drained instance would look busy for that long and every request
    would herd onto the others (measured: worse TTFT than round robin on random prompts).
    """
    kv_used = c.key[2]  # the fraction of KV blocks in use, as load_key has it
    per_request = w.decode_request_tokens if ctx.role is Role.DECODE else w.request_tokens
    tokens_weight = 0.25 if ctx.role is Role.DECODE else 1.0  # D: new tokens are cheap per token
    cached = max(c.cached_tokens, ctx.floor_tokens)
    return (cached - tokens_weight * c.inflight_tokens - per_request * c.inflight_requests
            - w.kv_full_tokens * kv_used)


def kv_aware(candidates: Sequence[Candidate], ctx: PickContext) -> Candidate:
    """The candidate with the best :func:`kv_aware_score`; ties take turns (``ctx.ties``, which only
    ties advance). A random tie-break sent two requests in a row to one of two idle instances half
    the time, which cost TTFT against round robin on random prompts (decision 048). The per-pick
    turn did not do either: a 4-turn conversation is four picks, three of them won by its D, so every
    conversation's first turn met the same parity and landed on the same D (decision 101)."""
    scores = [kv_aware_score(c, ctx) for c in candidates]
    best = max(scores)
    tied = [c for c, s in zip(candidates, scores, strict=True) if s == best]
    if len(tied) == 1:
        return tied[0]
    chosen = tied[ctx.ties % len(tied)]
    ctx.ties += 1
    return chosen


POLICIES: dict[Policy, PolicyFn] = {
    Policy.ROUND_ROBIN: round_robin,
    Policy.LEAST_LOADED: least_loaded,
    Policy.RANDOM: random_choice,
    Policy.KV_AWARE: kv_aware,
}
