"""Registry liveness rules with a fake clock (no threads, no sockets) + the sweeper thread."""

from __future__ import annotations

import time

import pytest

from kvwire.discovery import Deregister, Heartbeat, InstanceInfo, InstanceLoad
from kvwire.protocol.kv_params import Role
from kvwire.router.registry import ApplyResult, InstanceState, Registry
from kvwire.router.sweeper import RegistrySweeper


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hb(ident: str = "a", epoch: int = 1, seq: int = 1, role: Role = Role.BOTH,
       url: str | None = None, load: InstanceLoad | None = None) -> Heartbeat:
    info = InstanceInfo(instance_id=ident, epoch=epoch, role=role, url=url or f"http://h/{ident}", model="m")
    return Heartbeat(info=info, seq=seq, load=load)


def test_register_refresh_and_stale() -> None:
    reg = Registry(ttl_s=1.0)
    assert reg.apply(hb(seq=1)) is ApplyResult.REGISTERED
    assert reg.apply(hb(seq=2, load=InstanceLoad(num_running=3))) is ApplyResult.REFRESHED
    assert reg.live(Role.BOTH)[0].load == InstanceLoad(num_running=3)
    assert reg.apply(hb(seq=2)) is ApplyResult.STALE  # replay
    assert reg.apply(hb(seq=1)) is ApplyResult.STALE  # reordered
    assert reg.apply(hb(epoch=0, seq=9)) is ApplyResult.STALE  # older process


def test_new_epoch_replaces_and_same_url_takes_over() -> None:
    reg = Registry(ttl_s=1.0)
    reg.apply(hb(epoch=1, seq=50))
    assert reg.apply(hb(epoch=2, seq=1)) is ApplyResult.REPLACED  # restart: seq starts over
    assert reg.get("a").info.epoch == 2  # type: ignore[union-attr]
    assert reg.apply(hb(ident="b", url="http://h/a")) is ApplyResult.REPLACED
    assert [v.instance_id for v in reg.snapshot()] == ["b"]


def test_deregister_only_current_epoch() -> None:
    reg = Registry(ttl_s=1.0)
    reg.apply(hb(epoch=2))
    assert reg.apply(Deregister(instance_id="a", epoch=1)) is ApplyResult.STALE
    assert reg.apply(Deregister(instance_id="a", epoch=2)) is ApplyResult.DEREGISTERED
    assert reg.snapshot() == ()


def test_sweep_expires_then_forgets_and_heartbeat_revives() -> None:
    clock = Clock()
    reg = Registry(ttl_s=1.0, forget_after_s=5.0, clock=clock)
    reg.apply(hb(ident="a"))
    reg.apply(hb(ident="b"))
    clock.now += 0.9
    reg.apply(hb(ident="b", seq=2))
    assert reg.sweep() == []
    clock.now += 0.2  # a: 1.1 s silent, b: 0.2 s
    assert reg.sweep() == ["a"]
    assert reg.get("a").state is InstanceState.EXPIRED  # type: ignore[union-attr]
    assert [v.instance_id for v in reg.live(Role.BOTH)] == ["b"]
    reg.apply(hb(ident="a", seq=2))
    assert reg.get("a").alive  # type: ignore[union-attr]
    clock.now += 2.0
    assert sorted(reg.sweep()) == ["a", "b"]
    clock.now += 5.0
    assert sorted(reg.sweep()) == ["a", "b"]  # forgotten
    assert reg.snapshot() == ()


def test_expire_confirmed_silence_and_batches() -> None:
    """etcd mode: expire() takes out only entries silent past their promised TTL as of the time
    given (and never one that promised nothing); apply_many() applies a batch in order with one
    rebuild; a re-sync (touch_all) counts as hearing everyone."""
    clock = Clock()
    reg = Registry(ttl_s=100.0, clock=clock)
    results = reg.apply_many([Heartbeat(info=hb(ident=i).info, seq=1, ttl_s=2.0) for i in ("a", "b")]
                             + [hb(ident="old")])
    assert results == [ApplyResult.REGISTERED] * 3
    version = reg.version
    clock.now += 1.5
    assert reg.apply_many([Heartbeat(info=hb(ident="b").info, seq=2, ttl_s=2.0),
                           Heartbeat(info=hb(ident="b").info, seq=2, ttl_s=2.0)]) == [
        ApplyResult.REFRESHED, ApplyResult.STALE]
    assert reg.version == version + 1  # a refresh swaps one entry in place
    clock.now += 0.6  # a: 2.1 s silent; b: 0.6 s
    assert reg.expire(["a", "b", "old", "nobody"], as_of=clock.now - 0.2) == []  # a: 1.9 s then
    assert reg.expire(["a", "b", "old"], as_of=clock.now) == ["a"]
    assert reg.get("a").state is InstanceState.EXPIRED  # type: ignore[union-attr]
    reg.touch_all()
    clock.now += 1.0
    assert reg.expire(["b"], as_of=clock.now) == []
    assert {v.instance_id for v in reg.live(Role.BOTH)} == {"b", "old"}
    reg.apply(Heartbeat(info=hb(ident="a").info, seq=2, ttl_s=2.0))  # its next record: back
    assert reg.get("a").alive  # type: ignore[union-attr]
    dereg = Deregister(instance_id="b", epoch=reg.get("b").info.epoch)  # type: ignore[union-attr]
    assert reg.apply_many([dereg, hb(ident="old", seq=2)]) == [ApplyResult.DEREGISTERED,
                                                                 ApplyResult.REFRESHED]
    assert {v.instance_id for v in reg.live(Role.BOTH)} == {"a", "old"}


def test_mark_unreachable_until_next_heartbeat() -> None:
    reg = Registry(ttl_s=1.0)
    reg.apply(hb(epoch=3))
    assert not reg.mark_unreachable("a", 2, "old epoch")  # a failure seen on a previous process
    assert not reg.mark_unreachable("zzz", None, "unknown")
    assert reg.mark_unreachable("a", 3, "connect: refused")
    assert reg.live(Role.BOTH) == ()
    view = reg.get("a")
    assert view is not None and view.state is InstanceState.UNREACHABLE and "refused" in view.reason
    reg.apply(hb(epoch=3, seq=2))
    assert [v.instance_id for v in reg.live(Role.BOTH)] == ["a"]


def test_live_split_by_role_and_sorted() -> None:
    reg = Registry(ttl_s=1.0)
    P, D = Role.PREFILL, Role.DECODE
    for ident, role in (("p2", P), ("d1", D), ("p1", P)):
        reg.apply(hb(ident=ident, role=role))
    assert [v.instance_id for v in reg.live(Role.PREFILL)] == ["p1", "p2"]
    assert [v.instance_id for v in reg.live(Role.DECODE)] == ["d1"]
    assert reg.live(Role.BOTH) == ()


def test_sweeper_thread_expires_without_heartbeats() -> None:
    reg = Registry(ttl_s=0.05)
    reg.apply(hb())
    sweeper = RegistrySweeper(reg, interval_s=0.01).start()
    try:
        deadline = time.monotonic() + 5
        while reg.live(Role.BOTH) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reg.live(Role.BOTH) == ()
        assert reg.get("a").state is InstanceState.EXPIRED  # type: ignore[union-attr]
    finally:
        sweeper.close()
    assert not sweeper._thread.is_alive()


def _model_hb(ident: str, model: str, seq: int, role: Role, running: int) -> Heartbeat:
    info = InstanceInfo(instance_id=ident, epoch=1, role=role, url=f"http://h/{ident}", model=model)
    return Heartbeat(info=info, seq=seq, load=InstanceLoad(num_running=running))


def test_refresh_in_place_keeps_every_view_consistent() -> None:
    """A refresh swaps the entry into the cached tuples; they must equal a full rebuild's."""
    reg = Registry(ttl_s=1.0)
    specs = [("p0", "x", Role.PREFILL), ("p1", "y", Role.PREFILL),
             ("p2", "x", Role.PREFILL), ("d0", "x", Role.DECODE)]
    for ident, model, role in specs:
        reg.apply(_model_hb(ident, model, 1, role, 0))
    assert [v.instance_id for v in reg.live(Role.PREFILL, "x")] == ["p0", "p2"]
    assert [v.instance_id for v in reg.live(Role.PREFILL, "y")] == ["p1"]
    assert reg.live(Role.DECODE, "y") == ()
    version = reg.version
    assert reg.apply(_model_hb("p2", "x", 2, Role.PREFILL, 7)) is ApplyResult.REFRESHED
    assert reg.version == version + 1
    swapped = (reg.snapshot(), reg.live(Role.PREFILL), reg.live(Role.PREFILL, "x"))
    reg._rebuild()  # what a full rebuild gives
    assert swapped == (reg.snapshot(), reg.live(Role.PREFILL), reg.live(Role.PREFILL, "x"))
    assert reg.get("p2").load == InstanceLoad(num_running=7)  # type: ignore[union-attr]
    assert reg.live(Role.PREFILL, "x")[1].load == InstanceLoad(num_running=7)
    # An entry out of routing comes back through a full rebuild, in order.
    assert reg.mark_unreachable("p0", None, "test")
    assert [v.instance_id for v in reg.live(Role.PREFILL, "x")] == ["p2"]
    reg.apply(_model_hb("p0", "x", 2, Role.PREFILL, 1))
    assert [v.instance_id for v in reg.live(Role.PREFILL, "x")] == ["p0", "p2"]


def test_sweeper_wakes_at_the_earliest_expiry() -> None:
    clock = Clock()
    reg = Registry(ttl_s=1.0, forget_after_s=5.0, clock=clock)
    assert reg.seconds_to_next_change() is None
    reg.apply(hb("a"))
    clock.now += 0.3
    reg.apply(hb("b"))
    assert reg.seconds_to_next_change() == pytest.approx(0.7)  # a's TTL
    clock.now += 0.8
    assert reg.sweep() == ["a"]
    assert reg.seconds_to_next_change() == pytest.approx(0.2)  # b's TTL; a is forgotten at 5 s
    clock.now += 0.3
    reg.sweep()
    assert reg.seconds_to_next_change() == pytest.approx(5.0 - 1.4)  # a forgotten next


def test_sweeper_thread_expires_on_time_not_on_its_period() -> None:
    reg = Registry(ttl_s=0.3)
    sweeper = RegistrySweeper(reg, interval_s=10.0).start()  # a period far longer than the TTL
    try:
        reg.apply(hb("a"))
        t0 = time.monotonic()
        deadline = t0 + 5.0
        while reg.live(Role.BOTH) and time.monotonic() < deadline:
            time.sleep(0.005)
        took = time.monotonic() - t0
        assert not reg.live(Role.BOTH)
        assert 0.3 <= took < 1.0, took
    finally:
        sweeper.close()


def test_default_ttl_detects_a_death_within_three_heartbeat_intervals() -> None:
    """Decision 109: the default TTL is 2.5 heartbeat intervals (router and `kvwire up` alike), so
    an instance that dies right after a heartbeat is out of routing before 3 intervals have passed,
    with half an interval left for the network, the listener and the sweeper; a live instance whose
    next heartbeat comes 1.4 intervals late stays in."""
    from kvwire.cluster.local import ClusterSpec
    from kvwire.router.config import RouterConfig
    from kvwire.server.config import ServerConfig

    spec = ClusterSpec()
    interval = ServerConfig().heartbeat_interval_s
    assert RouterConfig().instance_ttl_s / interval == pytest.approx(2.5)
    assert spec.instance_ttl_s / spec.heartbeat_interval_s == pytest.approx(2.5)

    clock = Clock()
    start = clock.now
    reg = Registry(ttl_s=RouterConfig().instance_ttl_s, clock=clock)
    reg.apply(hb(ident="dead"))  # its last heartbeat
    reg.apply(hb(ident="late"))
    clock.now = start + interval
    reg.apply(hb(ident="late", seq=2))
    clock.now = start + 2.5 * interval - 0.01
    assert reg.sweep() == []
    clock.now = start + 2.5 * interval + 0.01
    assert reg.sweep() == ["dead"]
    assert clock.now - start < 3 * interval
    clock.now = start + 3.4 * interval  # "late": 2.4 intervals since its last, then it arrives
    assert reg.sweep() == []
    reg.apply(hb(ident="late", seq=3))
    assert reg.get("late").alive  # type: ignore[union-attr]
