"""Policies are pure: fairness and load awareness checked directly; Selector keeps per-role turns."""

from __future__ import annotations

import collections
import random

import pytest

from kvwire.discovery import Heartbeat, InstanceInfo, InstanceLoad
from kvwire.errors import NoInstanceError
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy
from kvwire.router.registry import Registry
from kvwire.router.selection import (
    Candidate,
    ModelNotFoundError,
    PickContext,
    Plan,
    Selector,
    least_loaded,
    load_key,
    random_choice,
    round_robin,
)


def cands(n: int, **loads: InstanceLoad) -> list[Candidate]:
    return [Candidate(f"i{k}", f"http://h/{k}", loads.get(f"i{k}")) for k in range(n)]


def test_load_key_reads_the_report() -> None:
    """Requests: the larger of the router's in-flight count and the reported running + waiting;
    then tokens; then the fraction of KV blocks in use (0 without a KV pool, clamped to [0, 1])."""
    def key(load: InstanceLoad | None, requests: int = 0) -> tuple[int, int, float]:
        return load_key(Candidate("i", "http://h", load, requests, 7))

    assert key(InstanceLoad(num_running=2, num_waiting=3), requests=1) == (5, 7, 0.0)
    assert key(InstanceLoad(num_running=2), requests=4)[0] == 4
    assert key(InstanceLoad(free_kv_blocks=25, total_kv_blocks=100))[2] == 0.75
    assert key(InstanceLoad(free_kv_blocks=150, total_kv_blocks=100))[2] == 0.0
    assert key(InstanceLoad(free_kv_blocks=-5, total_kv_blocks=100))[2] == 1.0
    assert key(InstanceLoad()) == (0, 7, 0.0)
    assert key(None, requests=2) == (2, 7, 0.0)


def run(policy, candidates: list[Candidate], picks: int, seed: int = 0) -> collections.Counter[str]:  # type: ignore[no-untyped-def]
    ctx = PickContext(turn=0, rng=random.Random(seed))
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(picks):
        counts[policy(candidates, ctx).instance_id] += 1
        ctx.turn += 1
    return counts


def test_round_robin_is_exactly_fair() -> None:
    assert run(round_robin, cands(3), 300) == {"i0": 100, "i1": 100, "i2": 100}


def test_random_is_roughly_fair() -> None:
    counts = run(random_choice, cands(4), 4000)
    assert set(counts) == {"i0", "i1", "i2", "i3"}
    assert all(800 < n < 1200 for n in counts.values())


def test_least_loaded_rotates_ties() -> None:
    assert run(least_loaded, cands(3), 30) == {"i0": 10, "i1": 10, "i2": 10}


def test_least_loaded_prefers_fewer_requests_then_tokens_then_kv() -> None:
    ctx = PickContext(turn=0, rng=random.Random(0))
    busy = InstanceLoad(num_running=5, num_waiting=2)
    assert least_loaded(cands(3, i0=busy, i1=busy), ctx).instance_id == "i2"
    tracked = [Candidate("a", "u", None, inflight_requests=3), Candidate("b", "u", None, inflight_requests=1)]
    assert least_loaded(tracked, ctx).instance_id == "b"
    by_tokens = [Candidate("a", "u", None, 1, 900), Candidate("b", "u", None, 1, 100)]
    assert least_loaded(by_tokens, ctx).instance_id == "b"
    kv = [Candidate("a", "u", InstanceLoad(free_kv_blocks=10, total_kv_blocks=100)),
          Candidate("b", "u", InstanceLoad(free_kv_blocks=90, total_kv_blocks=100))]
    assert least_loaded(kv, ctx).instance_id == "b"
    # Router-tracked in-flight counts beat a stale report that says idle.
    stale = [Candidate("a", "u", InstanceLoad(), inflight_requests=4), Candidate("b", "u", busy)]
    assert least_loaded(stale, ctx).instance_id == "a"


def _registry(*specs: tuple[str, Role, str]) -> Registry:
    reg = Registry(ttl_s=10)
    for ident, role, model in specs:
        info = InstanceInfo(instance_id=ident, role=role, url=f"http://h/{ident}", model=model)
        reg.apply(Heartbeat(info=info, seq=1))
    return reg


def test_selector_balances_by_inflight_and_keeps_turns_per_role() -> None:
    P, D = Role.PREFILL, Role.DECODE
    reg = _registry(("p0", P, "m"), ("p1", P, "m"), ("d0", D, "m"), ("d1", D, "m"), ("d2", D, "m"))
    sel = Selector(reg, Policy.ROUND_ROBIN)
    # Alternate P and D picks: with one global counter P would always land on the same instance.
    picks = [(sel.pick(P, None).instance_id, sel.pick(D, None).instance_id) for _ in range(6)]
    assert collections.Counter(p for p, _ in picks) == {"p0": 3, "p1": 3}
    assert collections.Counter(d for _, d in picks) == {"d0": 2, "d1": 2, "d2": 2}

    sel = Selector(reg, Policy.LEAST_LOADED)
    with sel.track("d0", 100), sel.track("d1", 10):
        assert sel.pick(D, None).instance_id == "d2"
        with sel.track("d2", 50):
            assert sel.pick(D, None).instance_id == "d1"  # equal requests: fewer tokens
        assert sel.inflight("d0") == (1, 100)
    assert sel.inflight("d0") == (0, 0)


def test_plan_and_errors() -> None:
    P, D, B = Role.PREFILL, Role.DECODE, Role.BOTH
    assert Selector(_registry(("p", P, "m"), ("d", D, "m")), Policy.RANDOM).plan("m") is Plan.DISAGGREGATED
    assert Selector(_registry(("b", B, "m"), ("p", P, "m")), Policy.RANDOM).plan(None) is Plan.COLOCATED
    with pytest.raises(NoInstanceError, match="no live decode"):
        Selector(_registry(("p", P, "m")), Policy.RANDOM).plan("m")
    with pytest.raises(NoInstanceError, match="no live instance"):
        Selector(_registry(), Policy.RANDOM).plan(None)
    with pytest.raises(ModelNotFoundError):
        Selector(_registry(("b", B, "m")), Policy.RANDOM).plan("other")
    sel = Selector(_registry(("b1", B, "x"), ("b2", B, "y")), Policy.ROUND_ROBIN)
    assert {sel.pick(B, "y").instance_id for _ in range(4)} == {"b2"}
