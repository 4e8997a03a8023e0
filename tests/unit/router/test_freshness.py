"""Freshness of signed discovery messages (decision 125): the guard's rules with a fake clock, then
the ZeroMQ listener refusing a replayed heartbeat over real loopback sockets."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from prometheus_client import generate_latest

from kvwire.discovery import Heartbeat, InstanceInfo, encode_frames
from kvwire.discovery.heartbeats import Deregister
from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import Role
from kvwire.router.cli import add_arguments, config_from_args
from kvwire.router.config import RouterConfig
from kvwire.router.discovery_backend import ZmqDiscovery
from kvwire.router.freshness import FreshnessGuard
from kvwire.router.listener import DiscoveryListener
from kvwire.router.metrics import RouterMetrics
from kvwire.router.registry import Registry
from support.waiting import wait_for

NOW = 1_000_000.0
SECRET = b"freshness-test-secret"


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_seq_must_grow_per_instance_and_epoch() -> None:
    guard = FreshnessGuard(30.0, clock=Clock())
    assert guard.check("a", 1, 1, NOW, 30.0) is None
    assert guard.check("a", 1, 2, NOW, 30.0) is None
    assert guard.check("a", 1, 2, NOW, 30.0) is not None  # the same message again
    assert "not after 2" in (guard.check("a", 1, 1, NOW, 30.0) or "")  # an older one
    assert guard.check("a", 1, 5, NOW, 30.0) is None  # gaps are fine (messages dropped on the way)
    assert guard.check("a", 2, 1, NOW, 30.0) is None  # a new epoch starts its own count
    assert guard.check("b", 1, 1, NOW, 30.0) is None  # and so does another instance


def test_first_message_of_an_epoch_must_be_inside_the_window() -> None:
    guard = FreshnessGuard(30.0, clock=Clock())
    assert "window 30.0 s" in (guard.check("a", 1, 7, NOW - 31, 30.0) or "")
    assert guard.check("a", 1, 7, NOW + 31, 30.0) is not None  # a clock far ahead is refused too
    assert guard.check("a", 1, 7, math.nan, 30.0) is not None
    assert guard.check("a", 1, 7, NOW - 29, 30.0) is None
    assert guard.check("z", 1, 1, NOW - 1e9, None) is None  # no time bound asked for


def test_a_forgotten_epoch_stays_refused_by_the_window() -> None:
    clock = Clock()
    guard = FreshnessGuard(30.0, clock=clock)
    assert guard.check("a", 1, 1, NOW, 30.0) is None
    assert guard.check("a", 1, 2, NOW + 1, 30.0) is None  # e.g. the deregistration
    clock.now = NOW + 20
    assert guard.check("a", 1, 1, NOW, 30.0) is not None  # remembered: refused by seq
    clock.now = NOW + 32  # past the newest sent_at + window: forgotten ...
    assert guard.check("x", 9, 1, clock.now, 30.0) is None  # (any call forgets what expired)
    assert len(guard) == 1
    assert "window" in (guard.check("a", 1, 2, NOW + 1, 30.0) or "")  # ... and a replay is too old


def test_repeats_allowed_for_etcd_records_and_entries_bounded() -> None:
    guard = FreshnessGuard(30.0, allow_repeat=True, max_entries=2, clock=Clock())
    assert guard.check("a", 1, 3, NOW, 30.0) is None
    assert guard.check("a", 1, 3, NOW, 30.0) is None  # a re-sync reads the same record again
    assert guard.check("a", 1, 2, NOW, 30.0) is not None  # an older record is still refused
    guard.seal("a", 1)  # its record was deleted: the same one put back is a replay
    assert guard.check("a", 1, 3, NOW, 30.0) is not None
    assert guard.check("a", 1, 4, NOW, 30.0) is None  # the instance itself puts a newer one
    assert guard.check("a", 1, 4, NOW, 30.0) is None
    guard.seal("unknown", 1)  # nothing to seal
    assert guard.check("b", 1, 1, NOW, 30.0) is None
    assert guard.check("c", 1, 1, NOW, 30.0) is None
    assert (len(guard), guard.evicted) == (2, 1)  # "a", the least recently heard from, went first


@pytest.mark.parametrize("window_s", [0.0, -1.0, math.inf, math.nan])
def test_window_validated(window_s: float) -> None:
    with pytest.raises(ConfigError):
        FreshnessGuard(window_s)


# --- the listener ----------------------------------------------------------------------------------


@pytest.fixture
def secured() -> Iterator[tuple[DiscoveryListener, Registry]]:
    registry = Registry(ttl_s=30.0)
    listener = DiscoveryListener(registry, "127.0.0.1", 0, SECRET).start()
    yield listener, registry
    listener.close()


def _push(address: str, frames_list: list[list[bytes]]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    for frames in frames_list:
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def _hb(ident: str, seq: int, sent_at: float, url: str | None = None) -> Heartbeat:
    info = InstanceInfo(instance_id=ident, role=Role.BOTH, url=url or f"http://127.0.0.1:9/{ident}",
                        model="m", epoch=7)
    return Heartbeat(info=info, seq=seq, sent_at=sent_at)


def test_listener_refuses_a_replayed_heartbeat_after_deregistration(
    secured: tuple[DiscoveryListener, Registry]
) -> None:
    listener, registry = secured
    now = time.time()
    captured = encode_frames(_hb("victim", 1, now), SECRET)
    _push(listener.address, [captured, encode_frames(Deregister(instance_id="victim", epoch=7, seq=2,
                                                                sent_at=now), SECRET)])
    wait_for(lambda: listener.received["deregistered"] == 1, 10.0, "registered, then deregistered")
    assert registry.get("victim") is None
    _push(listener.address, [captured, captured])  # the replay: signed, well-formed, old
    wait_for(lambda: listener.dropped["replayed"] == 2, 10.0, "replays dropped")
    assert registry.get("victim") is None  # the registry alone would have taken it back
    old = encode_frames(_hb("late", 1, now - 3600), SECRET)  # a first message from an hour ago
    _push(listener.address, [old, encode_frames(_hb("late", 2, time.time()), SECRET)])
    wait_for(lambda: registry.get("late") is not None, 10.0, "the fresh one registers")
    assert listener.dropped["replayed"] == 3 and listener.dropped["unauthenticated"] == 0


def test_listener_without_a_secret_checks_no_freshness() -> None:
    registry = Registry(ttl_s=30.0)
    listener = DiscoveryListener(registry, "127.0.0.1", 0).start()
    try:
        assert listener.freshness is None
        _push(listener.address, [encode_frames(_hb("old", 1, 0.0))])  # sent_at 1970: as today
        wait_for(lambda: registry.get("old") is not None, 10.0, "registered")
    finally:
        listener.close()


def test_flags_reach_the_listener_and_evictions_are_exported(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).discovery_freshness_s == 30.0
    (tmp_path / "secret").write_text("s" * 32)  # secrets come from a file or the environment (decision 124)
    cfg = config_from_args(parser.parse_args(["--discovery-freshness-s", "5", "--secret-file",
                                              str(tmp_path / "secret"),
                                              "--discovery-port", "0", "--max-instances", "3"]))
    discovery = ZmqDiscovery(Registry(ttl_s=5.0), cfg)
    try:
        guard = discovery.listener.freshness
        assert guard is not None and (guard.window_s, guard.max_entries) == (5.0, 30)
        for ident in range(31):  # one pair more than it may remember
            assert guard.check(str(ident), 1, 1, time.time(), 5.0) is None
        metrics = RouterMetrics()
        metrics.add_discovery(Registry(ttl_s=5.0), dict, dict,
                              freshness_evicted=lambda: discovery.freshness_evicted)
        scraped = generate_latest(metrics.registry).decode()
        assert "kvwire_router_discovery_freshness_evicted_total 1.0" in scraped
    finally:
        discovery.listener.close()
    with pytest.raises(ConfigError):
        RouterConfig(discovery_freshness_s=0.0)
