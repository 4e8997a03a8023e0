"""The discovery path against hostile peers and its own bugs (decision 117): the listener, the
sweeper and the heartbeat client are supervised threads; the registry bounds what peers choose.
Real ZeroMQ over loopback; the registry tests use a fake clock."""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvwire.discovery import Heartbeat, HeartbeatClient, InstanceInfo, encode_frames
from kvwire.discovery.heartbeats import MAX_FRAME_BYTES, KvEvents, decode_frames
from kvwire.errors import ProtocolError
from kvwire.protocol.kv_params import Role
from kvwire.router.listener import DiscoveryListener
from kvwire.router.registry import ApplyResult, KvIndex, Registry, clamp_ttl_s
from kvwire.router.sweeper import RegistrySweeper
from kvwire.supervision import HealthBoard
from support.waiting import wait_for


def nested_msgpack_frame(num_bytes: int = 60_000) -> bytes:
    """A heartbeat-tagged msgpack map whose unknown field ``junk`` nests arrays about ``num_bytes``
    deep (a one-element fixarray is one byte): the decoder recurses into it to skip it."""
    head = msgspec.msgpack.encode({"type": "heartbeat"})[1:]  # the map's one entry, without its header
    return b"\x82" + head + msgspec.msgpack.encode("junk") + b"\x91" * (num_bytes - 64) + b"\x90"


def _info(ident: str = "i0", url: str | None = None) -> InstanceInfo:
    url = url or f"http://127.0.0.1:9/{ident}"
    return InstanceInfo(instance_id=ident, role=Role.BOTH, url=url, model="m", epoch=1)


def _hb(ident: str = "i0", seq: int = 1, ttl_s: float = 0.0, url: str | None = None) -> Heartbeat:
    return Heartbeat(info=_info(ident, url), seq=seq, ttl_s=ttl_s)


@pytest.fixture
def listener() -> Iterator[tuple[DiscoveryListener, Registry, HealthBoard]]:
    board = HealthBoard()
    registry = Registry(ttl_s=30.0)
    lis = DiscoveryListener(registry, "127.0.0.1", 0, board=board).start()
    yield lis, registry, board
    lis.close()


def _pusher(address: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return ctx, sock


def test_nested_msgpack_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="RecursionError"):
        decode_frames([nested_msgpack_frame(), b""])


def test_nested_frame_leaves_the_listener_serving(
    listener: tuple[DiscoveryListener, Registry, HealthBoard],
) -> None:
    lis, registry, board = listener
    ctx, sock = _pusher(lis.address)
    try:
        sock.send_multipart(encode_frames(_hb(seq=1)))
        wait_for(lambda: registry.get("i0") is not None, 10, "i0 registered")
        sock.send_multipart([nested_msgpack_frame(), b""])
        wait_for(lambda: lis.dropped["malformed"] == 1, 10, "the hostile frame dropped")
        sock.send_multipart(encode_frames(_hb(seq=2)))
        wait_for(lambda: registry.get("i0").last_seq == 2, 10, "the next heartbeat applied")  # type: ignore[union-attr]
        assert board.restarts() == {} and board.dead() == []  # caught at the decoder: no restart
    finally:
        sock.close()
        ctx.term()


def test_oversized_frame_drops_its_connection_only(
    listener: tuple[DiscoveryListener, Registry, HealthBoard],
) -> None:
    lis, registry, _ = listener
    ctx, good = _pusher(lis.address)
    bad = ctx.socket(zmq.PUSH)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(lis.address)
    try:
        bad.send_multipart([b"\x00" * (MAX_FRAME_BYTES + 1), b""])  # ZeroMQ's MAXMSGSIZE: dropped unread
        wait_for(lambda: lis.connections_dropped >= 1, 10, "the oversized sender dropped")
        good.send_multipart(encode_frames(_hb(seq=1)))
        wait_for(lambda: registry.get("i0") is not None, 10, "a well-behaved instance registers")
        assert lis.dropped["malformed"] == 0  # never buffered nor decoded
    finally:
        bad.close()
        good.close()
        ctx.term()


def test_a_failing_listener_loop_is_restarted(
    listener: tuple[DiscoveryListener, Registry, HealthBoard], monkeypatch: pytest.MonkeyPatch,
) -> None:
    lis, registry, board = listener
    real_drain = lis._drain
    failures = [RecursionError("injected")]

    def drain_once_failing() -> bool:
        if failures:
            raise failures.pop()
        return real_drain()

    monkeypatch.setattr(lis, "_drain", drain_once_failing)
    wait_for(lambda: board.restarts().get("kvwire-discovery") == 1, 10, "the listener restarted")
    ctx, sock = _pusher(lis.address)
    try:
        sock.send_multipart(encode_frames(_hb(seq=1)))
        wait_for(lambda: registry.get("i0") is not None, 10, "a heartbeat applied after the restart")
        assert board.dead() == []
    finally:
        sock.close()
        ctx.term()


def test_registry_refuses_new_instances_beyond_its_size() -> None:
    registry = Registry(ttl_s=30.0, max_instances=2)
    assert registry.apply(_hb("a")) is ApplyResult.REGISTERED
    assert registry.apply_many([_hb("b"), _hb("c")]) == [ApplyResult.REGISTERED, ApplyResult.REFUSED]
    assert registry.apply(_hb("a", seq=2)) is ApplyResult.REFRESHED  # known ones still refresh
    # a new process at a known URL replaces its entry, full or not
    assert registry.apply(_hb("a2", url=_info("a").url)) is ApplyResult.REPLACED
    assert sorted(v.instance_id for v in registry.snapshot()) == ["a2", "b"]


@pytest.mark.parametrize(("promised", "kept"), [
    (math.inf, 60.0), (1e300, 60.0), (math.nan, 0.0), (-5.0, 0.0), (-math.inf, 0.0), (6.0, 6.0), (0.0, 0.0),
])
def test_promised_ttl_is_clamped_to_the_router_cap(promised: float, kept: float) -> None:
    assert clamp_ttl_s(promised, 60.0) == kept
    registry = Registry(ttl_s=5.0, max_record_ttl_s=60.0)
    registry.apply(_hb(ttl_s=promised))
    view = registry.get("i0")
    assert view is not None and view.ttl_s == kept
    assert registry.ttl_clamped == (0 if promised in (6.0, 0.0) else 1)


def test_a_failing_sweep_is_restarted() -> None:
    board = HealthBoard()
    registry = Registry(ttl_s=0.05)
    calls: list[int] = []
    real_sweep = registry.sweep

    def sweep() -> list[str]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_sweep()

    registry.sweep = sweep  # type: ignore[method-assign]
    sweeper = RegistrySweeper(registry, interval_s=0.01, board=board).start()
    try:
        registry.apply(_hb())
        wait_for(lambda: registry.get("i0") is not None and not registry.get("i0").alive,  # type: ignore[union-attr]
                 10, "i0 expired by the restarted sweeper")
        assert board.restarts() == {"kvwire-registry-sweeper": 1}
    finally:
        sweeper.close()
    assert board.snapshot() == []  # stopped on purpose


def test_heartbeat_thread_that_raises_is_restarted_and_registers_again(
    listener: tuple[DiscoveryListener, Registry, HealthBoard],
) -> None:
    lis, registry, _ = listener
    board = HealthBoard()
    client = HeartbeatClient(lis.address, _info(), interval_s=0.05, board=board)
    real = client._heartbeat
    failures = [RuntimeError("injected")]

    def heartbeat() -> Heartbeat:
        if failures:
            raise failures.pop()
        return real()

    client._heartbeat = heartbeat  # type: ignore[method-assign]
    with client:
        wait_for(lambda: registry.get("i0") is not None, 10, "registered after the restart")
        assert board.restarts() == {"kvwire-heartbeat": 1} and board.dead() == []
    wait_for(lambda: registry.get("i0") is None, 10, "deregistered on close")


def test_heartbeat_thread_that_keeps_failing_is_dead_on_the_board() -> None:
    board = HealthBoard()
    client = HeartbeatClient("tcp://127.0.0.1:9", _info(), interval_s=0.05, board=board)

    def heartbeat() -> Heartbeat:
        raise RuntimeError("injected for good")

    client._heartbeat = heartbeat  # type: ignore[method-assign]
    with client:
        wait_for(lambda: board.dead() != [], 30, "the heartbeat component dead")
        body = board.health_body()
        assert body is not None and "kvwire-heartbeat" in str(body["reason"])


def test_kv_events_of_instances_not_registered_are_ignored() -> None:
    """KV events from a peer that never registered (or under another epoch) left state in the index
    that nothing removed, and each block size they named cost every request a pass over its prompt:
    they are ignored (counted); the registered instance's events still land."""
    index = KvIndex()
    registry = Registry(ttl_s=30.0, on_remove=index.drop)
    lis = DiscoveryListener(registry, "127.0.0.1", 0, kv_index=index).start()
    ctx, sock = _pusher(lis.address)
    try:
        sock.send_multipart(encode_frames(_hb("i0")))  # epoch 1
        for n in range(200):
            sock.send_multipart(encode_frames(KvEvents(instance_id=f"ghost-{n}", epoch=1, block_size=n + 1,
                                                       stored=[n])))
        sock.send_multipart(encode_frames(KvEvents(instance_id="i0", epoch=2, block_size=16, stored=[7])))
        sock.send_multipart(encode_frames(KvEvents(instance_id="i0", epoch=1, block_size=16, stored=[1, 2])))
        wait_for(lambda: lis.received["kv_events"] == 1 and lis.received["kv_events_ignored"] == 201,
                 timeout_s=20.0, what="every KV event handled")
        assert index.num_blocks("i0") == 2 and len(index) == 2
        assert all(index.block_size(f"ghost-{n}") is None for n in range(200))
        assert index.holders(lambda block_size: [1] if block_size == 16 else [99]) == {"i0"}
    finally:
        sock.close()
        ctx.term()
        lis.close()


def test_a_registration_naming_a_kv_endpoint_no_peer_can_reach_is_refused(
    listener: tuple[DiscoveryListener, Registry, HealthBoard],
) -> None:
    """The router forwards an instance's kv_endpoints to its peers as peer_endpoints, which answer a
    malformed one with a 400 (decision 150): such a heartbeat never registers (dropped as malformed)."""
    lis, registry, _ = listener
    ctx, sock = _pusher(lis.address)
    try:
        bad = Heartbeat(info=msgspec.structs.replace(_info("bad"), kv_endpoints=["not-an-endpoint"]), seq=1)
        sock.send_multipart(encode_frames(bad))
        wait_for(lambda: lis.dropped["malformed"] == 1, 10, "the heartbeat refused")
        endpoints = ["tcp://127.0.0.1:7001"]
        good = Heartbeat(info=msgspec.structs.replace(_info("good"), kv_endpoints=endpoints), seq=1)
        sock.send_multipart(encode_frames(good))
        wait_for(lambda: registry.get("good") is not None, 10, "a well-formed instance registers")
        assert registry.get("bad") is None
    finally:
        sock.close()
        ctx.term()
