"""Choosing instances for one request, in order: the policies (pure functions that pick one
instance from a snapshot), the :class:`Selector` (the dispatch plan, policy picks, in-flight
accounting), KV-aware P/D planning (D first, then P, partial transfers, skipped prefills) and the
router's prompt tokenizer (the prompt's token ids, as the instances compute them). Event-loop
thread only; no torch.

**Policies.** A policy is ``(candidates, ctx) -> Candidate``. ``candidates`` is a non-empty sequence sorted by
instance id (the registry's order) combined with the router's own in-flight counts; ``ctx`` carries
the caller-held state (a per-role turn counter, a random generator). Policies keep no state of their
own, so they are trivially testable; P and D are picked by separate calls with separate turns.
To add a policy: write the function and list it in :data:`POLICIES`.

``kv_aware`` (decision 045) also reads, per candidate, the prompt tokens it already holds in its
prefix cache (``cached_tokens``, from the router's KV index) and, in the context, the request's
prompt length and the role being picked.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from kvwire import hub
from kvwire.discovery.heartbeats import InstanceLoad
from kvwire.errors import KvwireError, NoInstanceError, RouterError
from kvwire.protocol.kv_blocks import BlockHash, block_hashes
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy
from kvwire.router.registry import InstanceView, KvIndex, Registry
from kvwire.router.request import ClientRequest
from kvwire.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)


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
    load = c.load
    if load is None:
        return (c.inflight_requests, c.inflight_tokens, 0.0)
    reported = load.num_running + load.num_waiting
    # the fraction of KV blocks in use (0.0 when the instance reports no KV pool)
    kv_used = 0.0 if load.total_kv_blocks <= 0 else \
        1.0 - max(0.0, min(1.0, load.free_kv_blocks / load.total_kv_blocks))
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


# --- the selector ------------------------------------------------------------------------------------
# Choosing instances for one request: the dispatch plan, policy picks, in-flight accounting.
#
# Runs on the router's event loop only (no locks): the registry is read through its immutable
# snapshots.


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


# --- KV-aware P/D planning ---------------------------------------------------------------------------
# KV-aware P/D planning (policy ``kv_aware``, decision 045): D first, then P, partial transfers and
# skipped prefills.
#
# * D is picked first, by its cached prefix of the prompt against its load (multi-turn: the D that
#   served the previous turn holds it).
# * When D holds all but fewer than ``decode_local_prefill_tokens`` of the prompt, P is skipped: D
#   gets the plain request and prefills the rest from its own prefix cache.
# * Otherwise P is picked by its own cached prefix against its load, and P is told (``skip_blocks`` in
#   ``kv_transfer_params``) not to send the leading blocks D holds. D checks on admission that it still
#   holds them; if it evicted some since, it drops the transfer and prefills locally (correct, slower).
#
# Event-loop thread only; no torch.


@dataclass(frozen=True)
class PushPlan:
    decode: Picked
    prefill: Picked | None  # None: P skipped, D prefills the remaining prompt tokens itself
    skip_blocks: int = 0  # leading prompt blocks D holds, which P does not send

    @property
    def partial(self) -> bool:
        return self.prefill is not None and self.skip_blocks > 0


def prefix_for(selector: Selector, tokenizer: PromptTokenizer, creq: ClientRequest) -> Prefix | None:
    """The request's prompt tokens, tokenized as the model's instances do (None: unknown)."""
    announced = ""
    for role in (Role.DECODE, Role.PREFILL, Role.BOTH):
        for view in selector.live_views(role, creq.model):
            if view.info.tokenizer:
                announced = view.info.tokenizer
                break
        if announced:
            break
    ids = tokenizer.token_ids(creq.path, creq.body, announced)
    if ids is None:
        return None
    creq.prompt_token_ids = ids
    return Prefix(tuple(ids))


def plan_push(
    selector: Selector, model: str | None, prefix: Prefix | None, decode_local_prefill_tokens: int
) -> PushPlan:
    """Pick D, then P (or no P); see the section's head above."""
    if prefix is None:
        d = selector.pick_for(Role.DECODE, model)
        return PushPlan(d, selector.pick_for(Role.PREFILL, model or d.view.info.model))
    # A D without the prefix still gets what the best P holds, less the hand-over (decision 101).
    via_p = selector.best_cached(Role.PREFILL, model, prefix) - selector.weights.handover_tokens
    d = selector.pick_for(Role.DECODE, model, prefix, floor_tokens=max(0, int(via_p)))
    model = model or d.view.info.model  # P must serve the model D serves
    n = len(prefix.token_ids)
    if d.cached_tokens > 0 and n - d.cached_tokens < decode_local_prefill_tokens:
        return PushPlan(d, None)
    p = selector.pick_for(Role.PREFILL, model, prefix)
    skip = 0
    if d.cached_tokens > 0 and d.block_size > 0:
        # At least the block holding the last prompt token travels (D needs the whole prompt's KV).
        skip = min(d.cached_tokens // d.block_size, (n - 1) // d.block_size)
    return PushPlan(d, p, skip)


# --- the prompt's tokens -----------------------------------------------------------------------------
# The router's prompt tokenizer: a request's prompt token ids, as the serving instances compute them.
#
# KV-aware routing hashes the prompt's blocks and looks them up in the KV index, so the router must
# tokenize exactly like the instances: completions' ``prompt`` (text, or token ids taken as they
# are) with the model's tokenizer, chat ``messages`` through its chat template (the same
# :mod:`kvwire.tokenizer` code the built-in engine runs). Which tokenizer: ``--tokenizer`` when given
# (``byte`` or a local Hugging Face model directory), else what the instances announce
# (``InstanceInfo.tokenizer``). A tokenizer that cannot be loaded, or a prompt it cannot handle,
# gives ``None`` (logged once per tokenizer): the request is then routed on load alone.

BYTE = "byte"


class PromptTokenizer:
    """Loads tokenizers lazily, one per spec; event-loop thread only."""

    def __init__(self, override: str | None = None) -> None:
        self._override = override or None
        self._loaded: dict[str, Tokenizer | None] = {}

    def tokenizer(self, announced: str) -> Tokenizer | None:
        spec = self._override or announced
        if not spec:
            return None
        if spec not in self._loaded:
            self._loaded[spec] = _load(spec)
        return self._loaded[spec]

    def token_ids(self, path: str, body: dict[str, Any], announced: str) -> list[int] | None:
        """The prompt's token ids for a completions (``path`` not ending in ``/chat/completions``) or
        chat body; None when unknown (no tokenizer, or a prompt the instance will reject)."""
        if path.endswith("/chat/completions"):
            messages = _chat_messages(body.get("messages"))
            tok = None if messages is None else self.tokenizer(announced)
            if messages is None or tok is None:
                return None
            try:
                return tok.apply_chat_template(messages)
            except KvwireError:
                return None
        prompt = _single_prompt(body.get("prompt"))
        if prompt is None or isinstance(prompt, list):
            return prompt
        tok = self.tokenizer(announced)
        return None if tok is None else tok.encode(prompt)


def _load(spec: str) -> Tokenizer | None:
    if spec == BYTE:
        return ByteTokenizer()
    try:
        path = Path(spec)
        if not path.is_dir() and hub.is_repo_id(spec):  # --tokenizer ORG/NAME: the Hugging Face cache
            path = hub.resolve_tokenizer(spec)
        return HFTokenizer.from_dir(path)
    except (KvwireError, OSError, ImportError, ValueError) as exc:
        log.warning("KV-aware routing: cannot load tokenizer %r (%s); routing such requests on load only",
                    spec, exc)
        return None


def _single_prompt(prompt: Any) -> str | list[int] | None:
    """The server's accepted prompt shapes (``prompt_token_source``); None for anything else."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return list(prompt)
    return None


def _chat_messages(messages: Any) -> list[dict[str, Any]] | None:
    """Messages flattened like the server's ``chat_messages`` (text content parts joined)."""
    if not isinstance(messages, list) or not messages:
        return None
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                return None
            content = "".join(parts)  # type: ignore[arg-type]
        elif content is None:
            content = ""
        if not isinstance(content, str):
            return None
        out.append({"role": m["role"], "content": content})
    return out
