"""Discovery wire messages and the HeartbeatClient (real ZeroMQ over loopback)."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from kvwire.discovery import (
    Deregister,
    Heartbeat,
    HeartbeatClient,
    InstanceInfo,
    InstanceLoad,
    decode_frames,
    encode_frames,
)
from kvwire.errors import AuthenticationError, ConfigError, ProtocolError
from kvwire.protocol.kv_params import Role


def _info(**kw: object) -> InstanceInfo:
    base: dict[str, object] = dict(
        instance_id="p0", role=Role.PREFILL, url="http://127.0.0.1:1", model="m"
    )
    base.update(kw)
    return InstanceInfo(**base)  # type: ignore[arg-type]


def test_round_trip_unsigned_and_signed() -> None:
    hb = Heartbeat(info=_info(kv_endpoints=["tcp://a:1"]), load=InstanceLoad(num_running=2), seq=3)
    assert decode_frames(encode_frames(hb)) == hb
    frames = encode_frames(hb, b"s3cret")
    assert decode_frames(frames, b"s3cret") == hb
    dereg = Deregister(instance_id="p0", epoch=5)
    assert decode_frames(encode_frames(dereg, b"k"), b"k") == dereg


def test_secret_enforced() -> None:
    hb = Heartbeat(info=_info())
    with pytest.raises(AuthenticationError):
        decode_frames(encode_frames(hb), b"k")  # unsigned
    with pytest.raises(AuthenticationError):
        decode_frames(encode_frames(hb, b"other"), b"k")  # wrong key
    payload, sig = encode_frames(hb, b"k")
    with pytest.raises(AuthenticationError):
        decode_frames([payload + b"x", sig], b"k")  # tampered


@pytest.mark.parametrize(
    "frames",
    [
        [b"not msgpack at all \xff"],
        [msgspec.msgpack.encode({"type": "nope"})],
        [msgspec.msgpack.encode({"type": "heartbeat", "info": {"instance_id": "x"}})],
        [b"a", b"b", b"c"],
        [b"x" * 100_000],
    ],
)
def test_malformed_rejected(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_frames(frames)


def test_bad_fields_and_version_rejected() -> None:
    with pytest.raises(ProtocolError, match="version"):
        decode_frames(encode_frames(Heartbeat(info=_info(), v=99)))
    with pytest.raises(ProtocolError, match="url"):
        decode_frames(encode_frames(Heartbeat(info=_info(url="ftp://x"))))
    with pytest.raises(ProtocolError, match="instance_id"):
        decode_frames(encode_frames(Heartbeat(info=_info(instance_id=""))))


@pytest.mark.parametrize("endpoint", ["kv-p0", "tcp://h", "tcp://h:70000", "http://h:1", "fake://p0", ""])
def test_a_kv_endpoint_no_peer_can_connect_to_is_refused_at_registration(endpoint: str) -> None:
    """The router hands an instance's kv_endpoints to its peers as peer_endpoints, which refuse one
    their control plane cannot connect to (a 400): the heartbeat naming it is refused instead."""
    bad = Heartbeat(info=_info(kv_endpoints=["tcp://127.0.0.1:7001", endpoint]))
    with pytest.raises(ProtocolError, match="kv_endpoints"):
        decode_frames(encode_frames(bad))
    good = Heartbeat(info=_info(kv_endpoints=["tcp://127.0.0.1:7001", "tcp://[::1]:7002", "ipc:///tmp/kv"]))
    assert decode_frames(encode_frames(good)) == good


def test_client_rejects_bad_config() -> None:
    with pytest.raises(ConfigError):
        HeartbeatClient("127.0.0.1:5", _info())
    with pytest.raises(ConfigError):
        HeartbeatClient("tcp://127.0.0.1:5", _info(), interval_s=0)


def _recv(sock: zmq.Socket, deadline_s: float = 5.0) -> list[bytes]:
    assert sock.poll(int(deadline_s * 1000)), "no discovery message before the deadline"
    return sock.recv_multipart()


def test_client_heartbeats_then_deregisters() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    calls = 0

    def load() -> InstanceLoad:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("load probe broke")
        return InstanceLoad(num_running=calls)

    try:
        client = HeartbeatClient(f"tcp://127.0.0.1:{port}", _info(), load, interval_s=0.05, secret="k")
        with client:
            first = decode_frames(_recv(sock), b"k")
            second = decode_frames(_recv(sock), b"k")
            assert isinstance(first, Heartbeat) and isinstance(second, Heartbeat)
            assert first.load == InstanceLoad(num_running=1)
            assert second.load is None  # load_fn raised: heartbeat still sent
            assert second.seq == first.seq + 1
        deadline = time.monotonic() + 5
        last = None
        while time.monotonic() < deadline:
            last = decode_frames(_recv(sock), b"k")
            if isinstance(last, Deregister):
                break
        assert isinstance(last, Deregister)
        assert last.epoch == client.info.epoch
        assert client._thread is not None and not client._thread.is_alive()
    finally:
        sock.close()
        ctx.term()


def test_client_reaches_a_router_that_starts_later() -> None:
    with socket.socket() as s:  # reserve a free port, then free it for the late "router"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HeartbeatClient(f"tcp://127.0.0.1:{port}", _info(), interval_s=0.05).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        assert client._thread is not None and client._thread.is_alive()  # no router yet: still running
        sock.bind(f"tcp://127.0.0.1:{port}")
        msg = decode_frames(_recv(sock))
        assert isinstance(msg, Heartbeat) and msg.info.instance_id == "p0"
    finally:
        client.close()
        sock.close()
        ctx.term()
