"""KV-aware routing, pure parts: shared block hashes, the instance's event log, the router's KV index,
the kv_aware policy, the router's prompt tokenizer and D-first planning (skipped prefill, partial)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvwire.discovery import Heartbeat, InstanceInfo, InstanceLoad, decode_frames, encode_frames
from kvwire.discovery.heartbeats import Deregister, KvEvents
from kvwire.errors import ProtocolError
from kvwire.protocol.kv_blocks import KvEventLog, block_hashes, hash_block
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy
from kvwire.router.registry import KvIndex, Registry
from kvwire.router.selection import (
    Candidate,
    PickContext,
    Prefix,
    PromptTokenizer,
    Selector,
    kv_aware,
    plan_push,
)
from kvwire.tokenizer import ByteTokenizer

BS = 4


# --- hashes -----------------------------------------------------------------------------------------


def test_block_hashes_are_chained_and_cover_full_blocks_only() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2
    assert a[0] == hash_block(0, [1, 2, 3, 4]) and a[1] == hash_block(a[0], [5, 6, 7, 8])
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] != b[0] and a[1] != b[1]  # the same second block after another first block differs
    assert all(0 <= h < 2**64 for h in a)


def test_block_hashes_memo_extends_in_place() -> None:
    memo: list[int] = []
    tokens = list(range(1, 14))
    assert block_hashes(tokens, BS, 8, memo) == block_hashes(tokens, BS)[:2]
    assert block_hashes(tokens, BS, None, memo) == block_hashes(tokens, BS) and len(memo) == 3


def test_block_hashes_do_not_depend_on_the_process() -> None:
    code = "from kvwire.protocol.kv_blocks import block_hashes; print(block_hashes(list(range(40)), 16))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)}).stdout
            for seed in ("1", "2")}
    assert outs == {f"{block_hashes(list(range(40)), 16)}\n"}


def test_router_modules_import_no_torch() -> None:
    code = ("import sys, kvwire.router.app, kvwire.router.selection, kvwire.protocol.kv_blocks, "
            "kvwire.tokenizer; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": ":".join(sys.path)}).stdout
    assert out.strip() == "False"


# --- instance-side event log ------------------------------------------------------------------------


def test_event_log_coalesces_between_drains() -> None:
    log = KvEventLog(BS)
    log.stored([1, 2, 3])
    log.removed([3])  # stored and evicted before anyone heard of it: nothing to say
    batch = log.drain()
    assert batch is not None and sorted(batch.stored) == [1, 2] and batch.removed == [] and not batch.cleared
    assert log.drain() is None
    log.removed([1])
    log.stored([1])  # evicted and stored again: the router's view is still right
    log.removed([2])
    batch = log.drain()
    assert batch is not None and batch.stored == [] and batch.removed == [2] and batch.num_cached_blocks == 1


def test_event_log_batches_are_bounded_and_resync_resends_everything() -> None:
    log = KvEventLog(BS)
    log.stored(range(10))
    first = log.drain(max_hashes=4)
    assert first is not None and len(first.stored) == 4
    rest = log.drain(max_hashes=100)
    assert rest is not None and len(rest.stored) == 6
    log.resync()
    again = log.drain(max_hashes=100)
    assert again is not None and again.cleared and sorted(again.stored) == list(range(10))


def test_event_log_stays_bounded_when_nobody_drains() -> None:
    log = KvEventLog(BS, max_pending=100)
    for k in range(50):  # an instance without a router: blocks come and go, nobody drains
        log.stored(range(k * 100, k * 100 + 100))
        log.removed(range(k * 100, k * 100 + 90))
    assert len(log._dirty) <= 100
    batch = log.drain(max_hashes=10_000)
    assert batch is not None and batch.cleared and len(batch.stored) == log.num_cached_blocks == 500


def test_block_manager_reports_stores_and_evictions() -> None:
    from kvwire.engine.scheduler import BlockManager

    log = KvEventLog(BS)
    bm = BlockManager(num_blocks=3, block_size=BS, events=log)
    tokens = list(range(1, 10))
    blocks = bm.allocate(3)
    bm.cache_blocks(tokens, blocks, 8)
    batch = log.drain()
    assert batch is not None and batch.stored == block_hashes(tokens, BS)
    bm.free(blocks)
    bm.allocate(3)  # reuses (evicts) every cached block
    batch = log.drain()
    assert batch is not None and sorted(batch.removed) == sorted(block_hashes(tokens, BS))


# --- wire ---------------------------------------------------------------------------------------------


def test_kv_events_round_trip_and_validation() -> None:
    msg = KvEvents(instance_id="d0", epoch=5, block_size=16, stored=[2**64 - 1, 3], removed=[7], seq=2)
    assert decode_frames(encode_frames(msg, b"k"), b"k") == msg
    with pytest.raises(ProtocolError):
        decode_frames(encode_frames(KvEvents(instance_id="d0", epoch=5, block_size=0)))


# --- router index ---------------------------------------------------------------------------------------


def ev(inst: str, stored: list[int], removed: list[int] | None = None, *, epoch: int = 1,
       cleared: bool = False) -> KvEvents:
    return KvEvents(instance_id=inst, epoch=epoch, block_size=BS, stored=stored, removed=removed or [],
                    cleared=cleared)


def test_index_matches_longest_held_prefix_per_instance() -> None:
    index = KvIndex()
    h = block_hashes(list(range(1, 17)), BS)  # 4 blocks
    index.apply(ev("a", h[:3]))
    index.apply(ev("b", [h[0], h[2], h[3]]))  # a hole at block 1: only block 0 counts
    assert index.match(["a", "b", "c"], lambda bs: h) == {"a": 3, "b": 1, "c": 0}
    index.apply(ev("a", [], [h[1]]))
    assert index.match(["a"], lambda bs: h) == {"a": 1}


def test_index_epochs_clears_drops_and_bound() -> None:
    index = KvIndex(max_blocks=3)
    index.apply(ev("a", [1, 2]))
    assert not index.apply(ev("a", [9], epoch=0))  # an older process's batch
    assert index.num_blocks("a") == 2
    index.apply(ev("a", [3], epoch=2))  # restarted: its old entries are gone
    assert index.num_blocks("a") == 1
    index.apply(ev("a", [4], cleared=True, epoch=2))
    assert index.num_blocks("a") == 1 and index.match(["a"], lambda bs: [4]) == {"a": 1}
    index.apply(ev("b", [5, 6, 7]))
    assert len(index) == 3 and index.num_dropped_blocks == 1  # least recently stored (4) went
    index.drop("b")
    assert len(index) == 0 and index.num_blocks("b") == 0


def test_registry_removal_drops_the_instance_from_the_index() -> None:
    index = KvIndex()
    registry = Registry(ttl_s=5.0, on_remove=index.drop)
    info = InstanceInfo(instance_id="d0", role=Role.DECODE, url="http://h:1", model="m", epoch=1)
    registry.apply(Heartbeat(info=info, seq=1))
    index.apply(KvEvents(instance_id="d0", epoch=1, block_size=BS, stored=[1]))
    registry.apply(Deregister(instance_id="d0", epoch=1, seq=2))
    assert index.num_blocks("d0") == 0


# --- policy ---------------------------------------------------------------------------------------------


def ctx(role: Role = Role.PREFILL, prompt: int = 1000, seed: int = 0) -> PickContext:
    return PickContext(turn=0, rng=random.Random(seed), role=role, prompt_tokens=prompt)


def test_kv_aware_prefers_the_cached_prefix_when_loads_are_equal() -> None:
    cands = [Candidate("a", "u"), Candidate("b", "u", cached_tokens=512)]
    assert kv_aware(cands, ctx()).instance_id == "b"


def test_kv_aware_balances_cache_against_load() -> None:
    busy = InstanceLoad(num_running=4, num_waiting=8, free_kv_blocks=10, total_kv_blocks=100)
    cached_but_busy = Candidate("a", "u", busy, inflight_requests=12, inflight_tokens=4000, cached_tokens=256)
    idle = Candidate("b", "u")
    assert kv_aware([cached_but_busy, idle], ctx()).instance_id == "b"
    slightly_busy = Candidate("a", "u", inflight_requests=1, inflight_tokens=100, cached_tokens=900)
    assert kv_aware([slightly_busy, idle], ctx()).instance_id == "a"


def test_kv_aware_ties_take_turns() -> None:
    cands = [Candidate(f"i{k}", "u", cached_tokens=64) for k in range(4)]
    c = ctx()
    picks = []
    for _ in range(8):
        picks.append(kv_aware(cands, c).instance_id)
        c.turn += 1  # as the selector does after each pick
    assert picks == ["i0", "i1", "i2", "i3"] * 2
    # picks without a tie (a conversation's later turns, won by its D) do not move the tie turn:
    # two idle instances still alternate between conversations of any length
    two = [Candidate("a", "u"), Candidate("b", "u")]
    holder_wins = [Candidate("a", "u"), Candidate("b", "u", cached_tokens=400)]
    c = ctx(Role.DECODE)
    firsts = []
    for _conversation in range(4):
        firsts.append(kv_aware(two, c).instance_id)
        c.turn += 1
        for _later_turn in range(3):
            assert kv_aware(holder_wins, c).instance_id == "b"
            c.turn += 1
    assert firsts == ["a", "b", "a", "b"]
    cands[2] = Candidate("i2", "u", cached_tokens=65)  # no tie: the best wins on every turn
    turns = [PickContext(turn=t, rng=random.Random(0)) for t in range(4)]
    assert {kv_aware(cands, t).instance_id for t in turns} == {"i2"}


def test_kv_aware_on_decode_prefers_the_longest_prefix() -> None:
    d = ctx(Role.DECODE)
    cands = [Candidate("a", "u", cached_tokens=100, inflight_requests=1),
             Candidate("b", "u", cached_tokens=700, inflight_requests=2)]
    assert kv_aware(cands, d).instance_id == "b"
    overloaded = [Candidate("a", "u", cached_tokens=100), Candidate("b", "u", cached_tokens=700,
                                                                     inflight_requests=40)]
    assert kv_aware(overloaded, d).instance_id == "a"


def test_kv_aware_floor_values_a_prefix_the_others_can_get_from_prefill() -> None:
    d = ctx(Role.DECODE, prompt=544)
    holder_busy = Candidate("a", "u", cached_tokens=512, inflight_requests=1, inflight_tokens=560)
    idle = Candidate("b", "u")
    assert kv_aware([holder_busy, idle], d).instance_id == "a"  # no floor: the cache wins
    d.floor_tokens = 512 - 256  # P holds the prefix: b gets it through P, less the hand-over
    assert kv_aware([holder_busy, idle], d).instance_id == "a"  # one request in flight: stay
    holder_busier = Candidate("a", "u", cached_tokens=512, inflight_requests=2, inflight_tokens=1120)
    assert kv_aware([holder_busier, idle], d).instance_id == "b"
    d.floor_tokens = 0
    assert kv_aware([holder_busier, idle], d).instance_id == "a"  # without the floor it would stay
    holder_idle = Candidate("a", "u", cached_tokens=512)
    assert kv_aware([holder_idle, idle], d).instance_id == "a"  # idle: skipping P beats P's path


# --- router tokenizer ---------------------------------------------------------------------------------


def test_prompt_tokenizer_matches_the_engine() -> None:
    tok = PromptTokenizer()
    byte = ByteTokenizer()
    assert tok.token_ids("/v1/completions", {"prompt": "hi there"}, "byte") == byte.encode("hi there")
    assert tok.token_ids("/v1/completions", {"prompt": [[5, 6, 7]]}, "") == [5, 6, 7]  # ids need no tokenizer
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.token_ids("/v1/chat/completions", {"messages": messages}, "byte") == byte.apply_chat_template(
        [{"role": "user", "content": "ab"}])
    assert tok.token_ids("/v1/completions", {"prompt": "x"}, "") is None  # no tokenizer known
    assert tok.token_ids("/v1/completions", {"prompt": 5}, "byte") is None  # the instance will reject it
    assert PromptTokenizer().token_ids("/v1/completions", {"prompt": "x"}, "/nonexistent/model") is None


# --- D-first planning ---------------------------------------------------------------------------------


def planner(cached: dict[str, list[int]]) -> tuple[Selector, Prefix]:
    registry = Registry(ttl_s=60.0)
    index = KvIndex()
    for i, role in enumerate((Role.PREFILL, Role.PREFILL, Role.DECODE,
                              Role.DECODE)):
        name = f"{role.value[0]}{i % 2}"
        info = InstanceInfo(instance_id=name, role=role, url=f"http://h:{i + 1}", model="m", epoch=1)
        registry.apply(Heartbeat(info=info, seq=1))
    prefix = Prefix(tuple(range(1, 401)))  # 400 tokens = 100 blocks of 4
    hashes = prefix.hashes(BS)
    for name, blocks in cached.items():
        index.apply(KvEvents(instance_id=name, epoch=1, block_size=BS, stored=hashes[blocks[0]:blocks[1]]))
    return Selector(registry, Policy.KV_AWARE, seed=0, kv_index=index), prefix


def test_plan_skips_prefill_when_decode_holds_nearly_everything() -> None:
    selector, prefix = planner({"d1": [0, 90]})  # 360 of 400 tokens
    plan = plan_push(selector, "m", prefix, decode_local_prefill_tokens=256)
    assert plan.decode.view.instance_id == "d1" and plan.prefill is None
    assert selector.hit_rate("d1") == pytest.approx(0.9)


def test_plan_partial_transfer_when_decode_holds_a_prefix() -> None:
    selector, prefix = planner({"d0": [0, 25], "p1": [0, 60]})
    plan = plan_push(selector, "m", prefix, decode_local_prefill_tokens=64)
    assert plan.decode.view.instance_id == "d0" and plan.prefill is not None
    assert plan.prefill.view.instance_id == "p1" and plan.prefill.cached_tokens == 240
    assert plan.skip_blocks == 25 and plan.partial


def test_plan_spreads_a_shared_prefix_to_an_idle_decode_through_prefill() -> None:
    """Both P hold a system prompt, one D too: that D skips P while idle; while it is busy the other
    D is picked (through P, which holds the prefix), so that D learns it as well (decision 101)."""
    selector, prefix = planner({"p0": [0, 100], "p1": [0, 100], "d1": [0, 100]})
    plan = plan_push(selector, "m", prefix, decode_local_prefill_tokens=256)
    assert plan.decode.view.instance_id == "d1" and plan.prefill is None
    with selector.track("d1", 416), selector.track("d1", 416):
        plan = plan_push(selector, "m", prefix, decode_local_prefill_tokens=256)
    assert plan.decode.view.instance_id == "d0" and plan.prefill is not None
    assert plan.prefill.cached_tokens == 400 and plan.skip_blocks == 0


def test_plan_without_prefix_or_cache_is_a_plain_pair() -> None:
    selector, prefix = planner({})
    plan = plan_push(selector, "m", prefix, decode_local_prefill_tokens=256)
    assert plan.prefill is not None and plan.skip_blocks == 0 and not plan.partial
    plan = plan_push(selector, "m", None, decode_local_prefill_tokens=256)
    assert plan.prefill is not None and plan.skip_blocks == 0
