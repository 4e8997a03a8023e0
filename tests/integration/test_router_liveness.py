"""Liveness against real mock processes: kill -9, restart, sweeper expiry, deregistration, secrets."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvwire.discovery import Heartbeat, InstanceInfo, encode_frames
from kvwire.protocol.kv_params import Role
from support.mock_instance import MockProcess, RouterThread, get_raw, live_ids, post, router_config
from support.waiting import wait_for

INTERVAL_S = 0.2


@pytest.fixture
def router_and_mocks(request: pytest.FixtureRequest) -> Iterator[tuple[RouterThread, list[MockProcess]]]:
    secret = getattr(request, "param", None)
    router = RouterThread(router_config(instance_ttl_s=3 * INTERVAL_S, secret=secret))
    mocks: list[MockProcess] = []
    yield router, mocks
    for mock in mocks:
        if mock.proc.poll() is None:
            os.kill(mock.proc.pid, signal.SIGCONT)  # in case a test left it stopped
        mock.kill()
    router.close()


def _spawn(router: RouterThread, mocks: list[MockProcess], ident: str, *extra: str) -> MockProcess:
    mock = MockProcess(router.discovery, ident, "--interval-s", str(INTERVAL_S), *extra)
    mocks.append(mock)
    return mock


def _served_by(router: RouterThread) -> str:
    code, data = post(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 200, data
    return str(json.loads(data)["served_by"])


def test_kill9_leaves_routing_fast_and_restart_comes_back(router_and_mocks: Any) -> None:
    router, mocks = router_and_mocks
    for ident in ("m0", "m1", "m2"):
        _spawn(router, mocks, ident)
    wait_for(lambda: live_ids(router) == {"m0", "m1", "m2"}, 10, "three instances live")
    assert {_served_by(router) for _ in range(6)} == {"m0", "m1", "m2"}  # round robin reaches all
    old_epoch = router.server.registry.get("m1").info.epoch  # type: ignore[union-attr]

    mocks[1].kill()
    killed_at = time.monotonic()
    wait_for(lambda: "m1" not in live_ids(router), 2 * INTERVAL_S, "m1 out of routing within 2 intervals")
    assert time.monotonic() - killed_at <= 2 * INTERVAL_S
    assert all(_served_by(router) in {"m0", "m2"} for _ in range(20))

    _spawn(router, mocks, "m1")
    wait_for(lambda: "m1" in live_ids(router), 10, "restarted m1 back in routing")
    assert router.server.registry.get("m1").info.epoch > old_epoch  # type: ignore[union-attr]
    assert "m1" in {_served_by(router) for _ in range(6)}


def test_sweeper_expires_silent_instance(router_and_mocks: Any) -> None:
    router, mocks = router_and_mocks
    mock = _spawn(router, mocks, "m0")
    wait_for(lambda: "m0" in live_ids(router), 10, "m0 live")
    os.kill(mock.proc.pid, signal.SIGSTOP)  # silent, but its connections stay open
    try:
        wait_for(lambda: "m0" not in live_ids(router), 3 * INTERVAL_S + 2, "m0 expired by the sweeper")
        view = router.server.registry.get("m0")
        assert view is not None and view.state.value == "expired" and "no heartbeat" in view.reason
        code, data = post(router.url, "/v1/completions", {"prompt": "x"})
        assert code == 503 and b"no live instance" in data
    finally:
        os.kill(mock.proc.pid, signal.SIGCONT)
    wait_for(lambda: "m0" in live_ids(router), 10, "m0 alive again after resuming")


def test_graceful_stop_deregisters_at_once(router_and_mocks: Any) -> None:
    router, mocks = router_and_mocks
    mock = _spawn(router, mocks, "m0")
    wait_for(lambda: "m0" in live_ids(router), 10, "m0 live")
    mock.stop()
    wait_for(lambda: router.server.registry.get("m0") is None, 2 * INTERVAL_S, "m0 deregistered")
    assert router.server.listener.received["deregistered"] == 1


def _send_raw(address: str, frames_list: list[list[bytes]]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(address)
        for frames in frames_list:
            sock.send_multipart(frames)
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("router_and_mocks", ["s3cret"], indirect=True)
def test_secret_enforced_and_malformed_dropped(router_and_mocks: Any) -> None:
    router, mocks = router_and_mocks
    info = InstanceInfo(instance_id="intruder", role=Role.BOTH, url="http://127.0.0.1:9", model="m")
    hb = Heartbeat(info=info, seq=1)
    _send_raw(router.discovery, [
        [b"\x00garbage"],  # unsigned and malformed
        encode_frames(hb),  # unsigned
        encode_frames(hb, b"wrong"),  # badly signed
        encode_frames(Heartbeat(info=info, seq=2, v=7), b"s3cret"),  # signed, unknown version
        [b"\x93\x01\x02", b"x"],  # signed garbage
    ])
    listener = router.server.listener
    wait_for(lambda: sum(listener.dropped.values()) == 5, 10, "five messages dropped")
    assert listener.dropped == {"unauthenticated": 4, "malformed": 1}
    wrong = _spawn(router, mocks, "wrong", "--secret", "nope")
    good = _spawn(router, mocks, "good", "--secret", "s3cret")
    wait_for(lambda: "good" in live_ids(router), 10, "signed instance registered")
    wait_for(lambda: listener.dropped["unauthenticated"] >= 5, 10, "wrong-secret heartbeats dropped")
    assert live_ids(router) == {"good"}
    metrics = get_raw(router.url, "/metrics")[1].decode()
    assert 'kvwire_router_discovery_dropped_total{reason="malformed"} 1.0' in metrics
    assert 'kvwire_router_instances{role="both",state="alive"} 1.0' in metrics
    assert wrong.proc.poll() is None and good.proc.poll() is None


def test_router_stop_cancels_requests_in_flight() -> None:
    router = RouterThread(router_config())
    mock: MockProcess | None = None
    try:
        mock = MockProcess(router.discovery, "m0", "--interval-s", str(INTERVAL_S))
        wait_for(lambda: "m0" in live_ids(router), 10, "m0 live")
        host, port = router.url.removeprefix("http://").split(":")
        data = json.dumps({"prompt": "hang", "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
            sock.sendall(head.encode() + data)
            wait_for(lambda: len(mock.stats()["requests"]) == 1, 10, "request in flight")
            t0 = time.monotonic()
            router.close(grace_s=0.5)
            assert time.monotonic() - t0 < 5  # 0.5 s grace, then in-flight handlers are cancelled
            wait_for(lambda: len(mock.stats()["disconnects"]) == 1, 10, "upstream request aborted")
    finally:
        if mock is not None:
            mock.kill()
        router.close()  # no-op when the test got as far as closing it
