"""The selector at many instances: samples instead of scanning, reuses candidates, same answers.

Pools here are larger than SAMPLE_SIZE, so the sampled paths run (the policies themselves are
tested in test_selection_policy.py and test_selection_kv_routing.py).
"""

from __future__ import annotations

import collections
import contextlib

from kvwire.discovery import Heartbeat, InstanceInfo, InstanceLoad
from kvwire.discovery.heartbeats import KvEvents
from kvwire.protocol.kv_blocks import block_hashes
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy
from kvwire.router.registry import KvIndex, Registry
from kvwire.router.selection import SAMPLE_SIZE, Prefix, Selector

BS = 4


def _pool(n: int, role: Role = Role.DECODE, busy: int = 0) -> Registry:
    reg = Registry(ttl_s=10.0)
    for i in range(n):
        info = InstanceInfo(instance_id=f"i{i:04d}", role=role, url=f"http://h/{i}", model="m")
        reg.apply(Heartbeat(info=info, seq=1, load=InstanceLoad(num_running=busy)))
    return reg


def _report(reg: Registry, i: int, seq: int, running: int) -> None:
    info = InstanceInfo(instance_id=f"i{i:04d}", role=Role.DECODE, url=f"http://h/{i}", model="m")
    reg.apply(Heartbeat(info=info, seq=seq, load=InstanceLoad(num_running=running)))


def test_round_robin_stays_exactly_fair_over_a_large_pool() -> None:
    n = 5 * SAMPLE_SIZE
    sel = Selector(_pool(n), Policy.ROUND_ROBIN)
    counts = collections.Counter(sel.pick(Role.DECODE, "m").instance_id for _ in range(3 * n))
    assert len(counts) == n and set(counts.values()) == {3}


def test_random_reaches_every_instance_evenly_through_the_samples() -> None:
    n = 4 * SAMPLE_SIZE
    sel = Selector(_pool(n), Policy.RANDOM, seed=5)
    counts = collections.Counter(sel.pick(Role.DECODE, "m").instance_id for _ in range(100 * n))
    assert len(counts) == n
    assert min(counts.values()) > 50 and max(counts.values()) < 150  # expected 100 each


def test_least_loaded_follows_new_reports_and_inflight_counts() -> None:
    """Candidates are reused between picks; a new report or an in-flight change must show at once."""
    reg = _pool(SAMPLE_SIZE + 8, busy=3)
    sel = Selector(reg, Policy.LEAST_LOADED, seed=1)
    _report(reg, 7, seq=2, running=0)  # the only idle one
    picks = {sel.pick(Role.DECODE, "m").instance_id for _ in range(200)}
    assert "i0007" in picks  # found by the samples that hold it
    with contextlib.ExitStack() as stack:  # this router's own requests on it: 6 > the others' 3
        for _ in range(6):
            stack.enter_context(sel.track("i0007", 100))
        assert "i0007" not in {sel.pick(Role.DECODE, "m").instance_id for _ in range(200)}
    assert "i0007" in {sel.pick(Role.DECODE, "m").instance_id for _ in range(200)}  # finished: idle again
    reg2 = _pool(4, busy=0)  # a pool the samples cover entirely: the pick is exact
    sel2 = Selector(reg2, Policy.LEAST_LOADED)
    for seq, busy_one in enumerate((0, 1, 2), start=2):
        for i in range(4):
            _report(reg2, i, seq=seq, running=5 if i != busy_one + 1 else 0)
        assert {sel2.pick(Role.DECODE, "m").instance_id for _ in range(8)} == {f"i{busy_one + 1:04d}"}


def test_kv_aware_never_samples_a_cache_hit_away() -> None:
    """Above SAMPLE_SIZE, kv_aware scores a sample plus every instance holding the prompt's first
    block: the one holding the prompt wins every pick, whatever the sample."""
    n = 8 * SAMPLE_SIZE
    reg = _pool(n)
    index = KvIndex()
    prompt = tuple(range(1, 65))
    hashes = block_hashes(list(prompt), BS)
    index.apply(KvEvents(instance_id="i0123", epoch=0, block_size=BS, stored=hashes))
    index.apply(KvEvents(instance_id="i0200", epoch=0, block_size=BS, stored=hashes[:2]))
    assert index.holders(lambda bs: block_hashes(list(prompt), bs)) == {"i0123", "i0200"}
    sel = Selector(reg, Policy.KV_AWARE, seed=2, kv_index=index)
    for _ in range(50):
        picked = sel.pick_for(Role.DECODE, "m", Prefix(prompt))
        assert picked.view.instance_id == "i0123" and picked.cached_tokens == len(prompt)
    other = Prefix(tuple(range(100, 164)))  # held nowhere: load decides, over samples
    assert len({sel.pick_for(Role.DECODE, "m", other).view.instance_id for _ in range(50)}) > 10


def test_kv_index_holders_per_block_size_and_after_drop() -> None:
    index = KvIndex()
    prompt = list(range(1, 33))
    index.apply(KvEvents(instance_id="a", epoch=0, block_size=4, stored=block_hashes(prompt, 4)[:1]))
    index.apply(KvEvents(instance_id="b", epoch=0, block_size=8, stored=block_hashes(prompt, 8)))
    index.apply(KvEvents(instance_id="c", epoch=0, block_size=8, stored=block_hashes(prompt, 8)[1:]))
    assert index.holders(lambda bs: block_hashes(prompt, bs)) == {"a", "b"}  # c lacks block 0
    index.drop("b")
    assert index.holders(lambda bs: block_hashes(prompt, bs)) == {"a"}
