"""A live router against hostile discovery peers and clients, with real mock instances (processes):
the discovery listener survives a frame that used to stop it, its death would show on /health, and
each cap on what peers choose holds (decision 117)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvwire.supervision import RestartPolicy
from support.mock_instance import MockProcess, RouterThread, get_raw, live_ids, post, router_config
from support.waiting import wait_for

INTERVAL_S = 0.2
TTL_S = 3 * INTERVAL_S


def nested_msgpack_frame(num_bytes: int = 60_000) -> bytes:
    """The frame of issue 33: a heartbeat-tagged map whose unknown field nests ~60,000 arrays."""
    return b"\x82\xa4type\xa9heartbeat\xa4junk" + b"\x91" * (num_bytes - 64) + b"\x90"


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[RouterThread, list[MockProcess]]]:
    overrides: dict[str, Any] = getattr(request, "param", {})
    router = RouterThread(router_config(instance_ttl_s=TTL_S, **overrides))
    mocks: list[MockProcess] = []
    try:
        yield router, mocks
    finally:
        for mock in mocks:
            mock.kill()
        router.close()


def _spawn(router: RouterThread, mocks: list[MockProcess], ident: str) -> MockProcess:
    mock = MockProcess(router.discovery, ident, "--interval-s", str(INTERVAL_S))
    mocks.append(mock)
    return mock


def _metrics(router: RouterThread) -> str:
    status, data = get_raw(router.url, "/metrics")
    assert status == 200
    return data.decode()


def test_nested_frame_on_the_discovery_port_leaves_discovery_working(cluster: Any) -> None:
    router, mocks = cluster
    _spawn(router, mocks, "m0")
    wait_for(lambda: live_ids(router) == {"m0"}, 20, "m0 live")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(router.discovery)
    try:
        sock.send_multipart([nested_msgpack_frame(), b""])
    finally:
        sock.close()
        ctx.term()
    listener = router.server.listener
    wait_for(lambda: listener.dropped["malformed"] == 1, 10, "the hostile frame dropped")
    refreshed = listener.received["refreshed"]
    # Heartbeats keep arriving for well past the TTL (3 TTLs' worth): the listener still runs.
    wait_for(lambda: listener.received["refreshed"] >= refreshed + 10, 30, "heartbeats applied after it")
    assert live_ids(router) == {"m0"}
    code, data = post(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 200 and json.loads(data)["served_by"] == "m0"
    status, body = get_raw(router.url, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert 'kvwire_router_discovery_dropped_total{reason="malformed"} 1.0' in _metrics(router)


def test_a_dead_discovery_listener_makes_health_503_naming_it(cluster: Any) -> None:
    router, _ = cluster
    listener = router.server.listener
    thread = listener._thread
    thread._policy = RestartPolicy(max_restarts=2, backoff_initial_s=0.01, backoff_max_s=0.02)

    def broken_drain() -> bool:
        raise RuntimeError("injected listener failure")

    listener._drain = broken_drain  # type: ignore[method-assign]
    wait_for(lambda: get_raw(router.url, "/health")[0] == 503, 30, "/health 503")
    body = json.loads(get_raw(router.url, "/health")[1])
    assert "kvwire-discovery" in body["reason"]
    assert body["dead_components"][0]["error"] == "RuntimeError: injected listener failure"
    metrics = _metrics(router)
    assert 'kvwire_component_restarts_total{component="kvwire-discovery"} 2.0' in metrics
    assert 'kvwire_component_up{component="kvwire-discovery"} 0.0' in metrics


@pytest.mark.parametrize("cluster", [{"max_instances": 1}], indirect=True)
def test_registry_refuses_instances_beyond_max_instances(cluster: Any) -> None:
    router, mocks = cluster
    _spawn(router, mocks, "m0")
    wait_for(lambda: live_ids(router) == {"m0"}, 20, "m0 live")
    _spawn(router, mocks, "m1")
    wait_for(lambda: router.server.listener.received["refused"] >= 1, 20, "m1 refused")
    assert live_ids(router) == {"m0"}
    assert 'kvwire_router_discovery_messages_total{result="refused"}' in _metrics(router)


@pytest.mark.parametrize("cluster", [{"upstream_max_connections_per_instance": 1}], indirect=True)
def test_requests_beyond_the_upstream_connection_limit_wait_for_one(cluster: Any) -> None:
    router, mocks = cluster
    mock = _spawn(router, mocks, "m0")
    wait_for(lambda: live_ids(router) == {"m0"}, 20, "m0 live")
    hanging = socket.create_connection(("127.0.0.1", router.port), timeout=20)
    body = json.dumps({"prompt": "hang", "max_tokens": 2}).encode()
    hanging.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: len(mock.stats()["requests"]) == 1, 20, "the hanging request holds the connection")
    result: list[tuple[int, bytes]] = []
    waiting = threading.Thread(target=lambda: result.append(
        post(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})))
    waiting.start()
    wait_for(lambda: "kvwire_router_upstream_connection_waits_total 1.0" in _metrics(router), 20,
             "the second request waits for a connection")
    assert result == []
    hanging.close()  # the router cancels the hanging request: its connection is freed
    waiting.join(timeout=30)
    assert result and result[0][0] == 200


def test_nested_json_and_oversized_headers_are_400_and_the_router_keeps_serving(cluster: Any) -> None:
    router, mocks = cluster
    _spawn(router, mocks, "m0")
    wait_for(lambda: live_ids(router) == {"m0"}, 20, "m0 live")
    nested = b'{"prompt": "x", "extra": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    code, data = post(router.url, "/v1/completions", None, raw=nested)
    assert code == 400 and b"too deeply" in data
    with socket.create_connection(("127.0.0.1", router.port), timeout=20) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 20_000 + b"\r\n\r\n")
        assert conn.recv(64).split(b"\r\n")[0].endswith(b" 400 Bad Request")  # aiohttp max_field_size
    code, data = post(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 200
    invalid = 'kvwire_router_requests_total{endpoint="/v1/completions",outcome="invalid"} 1.0'
    assert invalid in _metrics(router)


def test_an_instances_429_reaches_the_client_with_its_retry_after(cluster: Any) -> None:
    router, mocks = cluster
    _spawn(router, mocks, "m0")
    wait_for(lambda: live_ids(router) == {"m0"}, 20, "m0 live")
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=20)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "status=429"}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 429 and resp.getheader("Retry-After") == "1"
        assert b"mock m0 says 429" in resp.read()
    finally:
        conn.close()
    assert live_ids(router) == {"m0"}  # a full queue is not a dead instance


@pytest.mark.parametrize("cluster", [{"http_body_timeout_s": 0.5, "http_idle_timeout_s": 1.0}], indirect=True)
def test_slow_bodies_get_408_and_stalled_heads_are_closed(cluster: Any) -> None:
    """Slow-loris clients hold nothing: a body that stops arriving is answered 408 after
    --http-body-timeout-s; a connection whose head never completes is closed after
    --http-idle-timeout-s; the router keeps serving."""
    router, mocks = cluster
    _spawn(router, mocks, "m0")
    wait_for(lambda: live_ids(router) == {"m0"}, 20, "m0 live")
    with socket.create_connection(("127.0.0.1", router.port), timeout=20) as body_conn, \
            socket.create_connection(("127.0.0.1", router.port), timeout=20) as head_conn:
        body_conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        head_conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        assert body_conn.recv(64).split(b"\r\n")[0].endswith(b" 408 Request Timeout")
        assert head_conn.recv(64) == b""  # closed by the router, no answer
    code, _ = post(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 200
    assert 'outcome="body_timeout"} 1.0' in _metrics(router)


@pytest.mark.parametrize("cluster", [{"http_body_timeout_s": 0.5}], indirect=True)
def test_tokenize_on_the_router_bounds_its_body_like_completions(cluster: Any) -> None:
    """/tokenize and /detokenize are forwarded with the same bounds: a nested body is a 400 (was an
    uncaught RecursionError), one that stops arriving a 408; the router keeps serving."""
    router, mocks = cluster
    _spawn(router, mocks, "m0")
    wait_for(lambda: live_ids(router) == {"m0"}, 20, "m0 live")
    nested = b'{"prompt": "x", "extra": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    for path in ("/tokenize", "/detokenize"):
        code, data = post(router.url, path, None, raw=nested)
        assert code == 400 and b"too deeply" in data, (path, code, data[:200])
        with socket.create_connection(("127.0.0.1", router.port), timeout=20) as conn:
            conn.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": ')
            assert conn.recv(64).split(b"\r\n")[0].endswith(b" 408 Request Timeout")
    code, _ = post(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 200
