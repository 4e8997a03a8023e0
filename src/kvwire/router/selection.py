"""Choosing instances for one request: the dispatch plan, policy picks, in-flight accounting.

Runs on the router's event loop only (no locks): the registry is read through its immutable snapshots.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import overload

from kvwire.errors import NoInstanceError, RouterError
from kvwire.protocol.kv_blocks import BlockHash, block_hashes
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy
from kvwire.router.kv_index import KvIndex
from kvwire.router.policy import KV_AWARE_WEIGHTS, POLICIES, Candidate, KvAwareWeights, PickContext
from kvwire.router.registry import InstanceView, Registry


class Plan(str, enum.Enum):
    COLOCATED = "colocated"  # one `both` instance serves the whole request
    DISAGGREGATED = "pd"  # prefill on a `prefill` instance, decode on a `decode` instance
    # no live P (and no `both`) for the model: a `decode` instance serves the whole request itself
    DECODE_ALONE = "decode_alone"


# Above this many live instances of a role, least_loaded and random look at a random sample of this
# many (the "power of d choices": near the true least loaded, at a cost that does not grow with N),
# and kv_aware scores the instances holding the request's first block plus such a sample.
# round_robin always walks them all.
SAMPLE_SIZE = 32
_PERMUTATIONS_KEPT = 8  # sampling orders cached, by pool size


@dataclass(frozen=True)
class Prefix:
    """A request's prompt as KV-aware routing sees it: token ids and their block hashes per block size."""

    token_ids: tuple[int, ...]
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict, compare=False, repr=False)

    def hashes(self, block_size: int) -> list[BlockHash]:
        """The prompt's chained block hashes for ``block_size`` (computed once per size)."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = block_hashes(self.token_ids, block_size)
        return hashes


@dataclass(frozen=True)
class Picked:
    """One policy pick with what the KV index says the instance holds of the request's prompt."""

    view: InstanceView
    cached_tokens: int = 0
    block_size: int = 0  # of the instance's KV events (0 = none known)


class ModelNotFoundError(RouterError):
    """No instance, alive or not, serves the requested model (becomes HTTP 404)."""


class _Lazy(Sequence[Candidate]):
    """The candidates of ``views``, each built when a policy first reads it."""

    def __init__(self, views: Sequence[InstanceView], build: Callable[[InstanceView], Candidate]) -> None:
        self._views = views
        self._build = build

    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, index: int) -> Candidate: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Candidate]: ...

    def __getitem__(self, index: int | slice) -> Candidate | Sequence[Candidate]:
        if isinstance(index, slice):
            return [self._build(v) for v in self._views[index]]
        return self._build(self._views[index])


def _view_of(
    chosen: Candidate, views: Sequence[InstanceView], candidates: Sequence[Candidate]
) -> InstanceView:
    """The view ``chosen`` was built from (a policy returns one of its candidates)."""
    if isinstance(candidates, _Lazy):
        return next(v for v in views if v.instance_id == chosen.instance_id)
    return views[next(i for i, c in enumerate(candidates) if c is chosen)]


class Selector:
    """Picks for one router. Cost of a pick at N live instances of a role: O(1) for round_robin,
    O(SAMPLE_SIZE) for least_loaded and random, O(SAMPLE_SIZE + instances holding the prompt's
    first block) for kv_aware; no copy or sort of all N. Candidates are built once per instance
    report and reused while the instance's report and this router's in-flight counts for it stay
    the same (the steady state: reports arrive once per interval, picks far more often)."""

    def __init__(
        self, registry: Registry, policy: Policy, seed: int | None = None, kv_index: KvIndex | None = None,
        decode_alone: bool = True,
    ) -> None:
        self._registry = registry
        self.decode_alone = decode_alone  # --pd-fallback colocated: D serves when no P is live
        self._policy = POLICIES[policy]
        self.weights: KvAwareWeights = KV_AWARE_WEIGHTS
        self.kv_aware = policy is Policy.KV_AWARE
        self.kv_index = kv_index if kv_index is not None else KvIndex()
        # round_robin needs every live instance (its turn walks them); the others can sample
        self._sampled = policy is not Policy.ROUND_ROBIN
        self._rng = random.Random(seed)
        self._ctx = {role: PickContext(turn=0, rng=random.Random(seed), role=role) for role in Role}
        self._inflight: dict[str, list[int]] = {}  # instance id -> [requests, tokens]
        self._hits: dict[str, list[int]] = {}  # instance id -> [cached prompt tokens, prompt tokens] routed
        self._candidates: dict[str, tuple[InstanceView, Candidate]] = {}  # reusable, per instance
        self._orders: dict[int, list[int]] = {}  # pool size -> a random order of its positions

    def _live(self, role: Role, model: str | None) -> Sequence[InstanceView]:
        return self._registry.live(role, model)  # the registry's cached tuple: no copy

    def live_views(self, role: Role, model: str | None) -> Sequence[InstanceView]:
        """Live instances of ``role`` serving ``model`` (any model when None)."""
        return self._live(role, model)

    def _has_live(self, role: Role, model: str | None) -> bool:
        return bool(self._registry.live(role, model))

    def plan(self, model: str | None) -> Plan:
        """P/D when a prefill and a decode instance are live, else colocated, else (``decode_alone``)
        D alone; raises if none of these."""
        has_p = self._has_live(Role.PREFILL, model)
        has_d = self._has_live(Role.DECODE, model)
        if has_p and has_d:
            return Plan.DISAGGREGATED
        if self._has_live(Role.BOTH, model):
            return Plan.COLOCATED
        if has_d and self.decode_alone:
            return Plan.DECODE_ALONE
        self._check_model(model)
        for_model = f" for model {model!r}" if model else ""
        if has_p:
            raise NoInstanceError(f"no live decode instance{for_model} (prefill instances are up)")
        if has_d:
            raise NoInstanceError(f"no live prefill instance{for_model} (decode instances are up; "
                                  "the router runs with --pd-fallback error)")
        raise NoInstanceError(f"no live instance{for_model}")

    def servable_models(self) -> list[str]:
        """The models :meth:`plan` would serve now (``/v1/models``), sorted."""
        models = {v.info.model for v in self._registry.snapshot() if v.alive}
        return sorted(m for m in models if self._servable(m))

    def _servable(self, model: str) -> bool:
        if self._has_live(Role.BOTH, model):
            return True
        has_d = self._has_live(Role.DECODE, model)
        return has_d and (self.decode_alone or self._has_live(Role.PREFILL, model))

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = {v.info.model for v in self._registry.snapshot()}
        if known and model not in known:
            raise ModelNotFoundError(f"model {model!r} not found; served: {sorted(known)}")

    def pick(self, role: Role, model: str | None) -> InstanceView:
        """Pick a live instance of ``role`` by the policy; P and D keep separate turns."""
        return self.pick_for(role, model).view

    def pick_for(
        self, role: Role, model: str | None, prefix: Prefix | None = None, floor_tokens: int = 0
    ) -> Picked:
        """Pick as :meth:`pick`; with ``prefix`` (KV-aware routing) the candidates carry the prompt
        tokens each holds (KV index) and the pick records its expected hit for ``/instances``.
        ``floor_tokens``: see :attr:`PickContext.floor_tokens` (kv_aware)."""
        views = self._live(role, model)
        if not views:
            raise NoInstanceError(f"no live {role.value} instance")
        ctx = self._ctx[role]
        if self._sampled and len(views) > SAMPLE_SIZE:
            views = self._sample(views, role, model, prefix)
        cached = {} if prefix is None else self.kv_index.match([v.instance_id for v in views], prefix.hashes)
        candidates: Sequence[Candidate]
        if self._sampled or prefix is not None:
            candidates = [self._candidate(v, cached, prefix) for v in views]
        else:  # round_robin reads one candidate: build only that one
            candidates = _Lazy(views, lambda v: self._candidate(v, cached, prefix))
        ctx.prompt_tokens = 0 if prefix is None else len(prefix.token_ids)
        ctx.floor_tokens = floor_tokens
        chosen = self._policy(candidates, ctx)
        ctx.turn += 1
        view = _view_of(chosen, views, candidates)
        if prefix is None:
            return Picked(view)
        hits = self._hits.setdefault(view.instance_id, [0, 0])
        hits[0] += chosen.cached_tokens
        hits[1] += len(prefix.token_ids)
        return Picked(view, chosen.cached_tokens, self.kv_index.block_size(view.instance_id) or 0)

    def best_cached(self, role: Role, model: str | None, prefix: Prefix) -> int:
        """The most leading prompt tokens any live ``role`` instance holds (KV index); 0 if none.
        O(instances holding the prompt's first block)."""
        best = 0
        holders = self.kv_index.holders(prefix.hashes)
        if not holders:
            return 0
        live = [i for i in holders if (v := self._registry.get(i)) is not None and v.alive
                and v.role is role and model in (None, v.info.model)]
        for ident, num_blocks in self.kv_index.match(live, prefix.hashes).items():
            block_size = self.kv_index.block_size(ident) or 0
            best = max(best, min(num_blocks * block_size, len(prefix.token_ids)))
        return best

    def _sample(
        self, views: Sequence[InstanceView], role: Role, model: str | None, prefix: Prefix | None
    ) -> list[InstanceView]:
        """SAMPLE_SIZE of ``views`` at random: a window at a random offset into a random order of
        the pool's positions (each instance is in a window with the same chance, SAMPLE_SIZE / N).
        With a prompt (kv_aware), every live instance holding its first block is added: a cache
        hit is never sampled away, and the sample stands in for the best of the rest by load."""
        n = len(views)
        order = self._orders.get(n)
        if order is None:
            if len(self._orders) >= _PERMUTATIONS_KEPT:
                self._orders.clear()
            order = self._orders[n] = self._rng.sample(range(n), n)
        start = self._rng.randrange(n)
        positions = order[start:start + SAMPLE_SIZE]
        if len(positions) < SAMPLE_SIZE:
            positions += order[:SAMPLE_SIZE - len(positions)]
        sample = [views[i] for i in positions]
        if prefix is not None and self.kv_aware:
            seen = {v.instance_id for v in sample}
            for ident in sorted(self.kv_index.holders(prefix.hashes) - seen):
                view = self._registry.get(ident)
                if view is not None and view.alive and view.role is role and model in (None, view.info.model):
                    sample.append(view)
        return sample

    def _candidate(self, view: InstanceView, cached: dict[str, int], prefix: Prefix | None) -> Candidate:
        ident = view.instance_id
        inflight = self._inflight.get(ident)
        num_blocks = cached.get(ident, 0)
        if inflight is None and not num_blocks:
            # nothing of this router's on it and no cache hit: the candidate is the report alone
            known = self._candidates.get(ident)
            if known is not None and known[0] is view:
                return known[1]
            cand = Candidate(ident, view.url, view.load)
            self._candidates[ident] = (view, cand)
            return cand
        requests, tokens = inflight if inflight is not None else (0, 0)
        cached_tokens = 0
        if num_blocks and prefix is not None:
            block_size = self.kv_index.block_size(ident) or 0
            cached_tokens = min(num_blocks * block_size, len(prefix.token_ids))
        return Candidate(ident, view.url, view.load, requests, tokens, cached_tokens)

    def hit_rate(self, instance_id: str) -> float | None:
        """Share of the prompt tokens routed to ``instance_id`` (KV-aware picks) that it held cached."""
        hit, total = self._hits.get(instance_id, (0, 0))
        return hit / total if total else None

    def forget(self, instance_id: str) -> None:
        """``instance_id`` left: drop its KV index entries, hit counts and cached candidate."""
        self.kv_index.drop(instance_id)
        self._hits.pop(instance_id, None)
        self._candidates.pop(instance_id, None)

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
