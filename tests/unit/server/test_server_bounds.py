"""Bounds on what clients send an instance, and /health naming a dead component (decision 117)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from kvwire.server.cli import server_config_from_args
from kvwire.supervision import HealthBoard
from support.fake_engine_server import wait_until


def test_full_waiting_queue_is_429_with_retry_after(run_with_fake_server: Any, fake_engine: Any) -> None:
    fake_engine.step_gate = threading.Event()  # the first request's step hangs: the rest wait

    async def body(server: Any) -> None:
        req = {"prompt": "a", "max_tokens": 2}
        first = asyncio.create_task(server.client.post("/v1/completions", json=req))
        await wait_until(fake_engine.step_blocked.is_set, 10)
        waiting = [asyncio.create_task(server.client.post("/v1/completions", json=req)) for _ in range(2)]
        await wait_until(lambda: server.engine_loop.num_streams == 3, 10)
        assert server.engine_loop.num_waiting == 2
        refused = await server.client.post("/v1/completions", json=req)
        assert refused.status == 429
        assert refused.headers["Retry-After"] == "1"
        error = (await refused.json())["error"]
        assert error["reason"] == "queue_full" and error["code"] == 429
        assert "waiting queue is full (2 requests)" in error["message"]
        fake_engine.step_gate.set()
        for task in (first, *waiting):
            assert (await task).status == 200  # nothing admitted was lost
        metrics = await (await server.client.get("/metrics")).text()
        assert 'kvwire_requests_total{endpoint="completion",outcome="queue_full"} 1.0' in metrics
        assert (await server.client.post("/v1/completions", json=req)).status == 200  # room again

    run_with_fake_server(body, fake_engine, max_waiting_requests=2)


def test_deeply_nested_json_is_400_and_the_server_keeps_serving(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        nested = b'{"prompt": "a", "kv_transfer_params": {"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}"
        resp = await server.client.post("/v1/completions", data=nested,
                                        headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert "too deeply" in (await resp.json())["error"]["message"]
        ok = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert ok.status == 200

    run_with_fake_server(body)


def test_oversized_body_is_413_and_counted(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        resp = await server.client.post("/v1/completions", json={"prompt": "a" * 8192})
        assert resp.status == 413
        metrics = await (await server.client.get("/metrics")).text()
        assert 'kvwire_requests_total{endpoint="completion",outcome="too_large"} 1.0' in metrics

    run_with_fake_server(body, max_request_bytes=4096)


def test_oversized_header_is_400_and_the_server_keeps_serving(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                        headers={"X-Big": "x" * 20_000})
        assert resp.status == 400  # aiohttp's max_field_size (8190 bytes)
        ok = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert ok.status == 200

    run_with_fake_server(body)


def test_health_is_503_naming_a_dead_component(run_with_fake_server: Any) -> None:
    board = HealthBoard()
    key = board.register("kvwire-heartbeat")

    async def body(server: Any) -> None:
        assert (await server.client.get("/health")).status == 200
        board.mark_dead(key, "RuntimeError: injected")
        resp = await server.client.get("/health")
        assert resp.status == 503
        data = await resp.json()
        assert data["status"] == "component_dead" and "kvwire-heartbeat" in data["reason"]
        dead = [{"component": "kvwire-heartbeat", "error": "RuntimeError: injected"}]
        assert data["dead_components"] == dead

    run_with_fake_server(body, board=board)


def test_bound_flags_reach_the_config() -> None:
    import argparse

    from kvwire.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = server_config_from_args(parser.parse_args([]))
    assert defaults.max_waiting_requests == 1024 and defaults.max_request_bytes == 16 * 1024 * 1024
    cfg = server_config_from_args(parser.parse_args(["--max-waiting-requests", "7",
                                                     "--max-request-bytes", "5000"]))
    assert cfg.max_waiting_requests == 7 and cfg.max_request_bytes == 5000


def test_a_body_that_stops_arriving_is_408_and_the_server_keeps_serving(run_with_fake_server: Any) -> None:
    """A client that sends its head and part of its body, then nothing (slow-loris body), gets 408
    after --http-body-timeout-s instead of holding a handler for ever."""

    async def body(server: Any) -> None:
        reader, writer = await asyncio.open_connection(server.client.server.host, server.client.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        writer.close()
        metrics = await (await server.client.get("/metrics")).text()
        assert 'kvwire_requests_total{endpoint="completion",outcome="body_timeout"} 1.0' in metrics
        ok = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert ok.status == 200

    run_with_fake_server(body, body_timeout_s=0.5)


def test_http_deadline_flags() -> None:
    import argparse

    from kvwire.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = server_config_from_args(parser.parse_args(["--http-idle-timeout-s", "7",
                                                        "--http-body-timeout-s", "3"]))
    assert (config.http_idle_timeout_s, config.http_body_timeout_s) == (7.0, 3.0)


def test_a_tokenize_body_that_stops_arriving_is_408(run_with_fake_server: Any) -> None:
    """/tokenize and /detokenize read their bodies under the same --http-body-timeout-s."""

    async def body(server: Any) -> None:
        for path in (b"/tokenize", b"/detokenize"):
            reader, writer = await asyncio.open_connection(server.client.server.host,
                                                           server.client.server.port)
            writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 30)
            assert status_line.startswith(b"HTTP/1.1 408"), (path, status_line)
            writer.close()

    run_with_fake_server(body, body_timeout_s=0.5)


def test_a_peer_endpoint_the_control_plane_cannot_reach_is_400(run_with_fake_server: Any) -> None:
    """A ``peer_endpoints`` entry ZeroMQ cannot connect to cost only its transfer (decision 149), but
    at its lease, with the request admitted (and on P, D promised the transfer). It is a 400 at the
    edge now (decision 150), refused by the admission check before the connector's part of it
    (``endpoints_checked``) acts on the params: none of them passes the check."""
    checked: list[object] = []
    bad = ["not an endpoint", "tcp://", "http://127.0.0.1:1", "tcp://127.0.0.1:99999", "tcp://h:0",
           "fake://d0", "tcp://127.0.0.1:1 ", "ipc://", "x" * 600]

    async def body(server: Any) -> None:
        check = server.generation._check_kv

        def passed(params: object) -> object:
            result = check(params)
            checked.append(params)
            return result

        server.generation._check_kv = passed
        for endpoint in bad:
            kv = {"transfer_id": "t", "role": "prefill", "peer_endpoints": ["tcp://127.0.0.1:7001", endpoint]}
            resp = await server.client.post("/v1/completions", json={"prompt": "a", "kv_transfer_params": kv})
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["param"] == "kv_transfer_params", (endpoint, error)
            assert error["code"] == 400 and "peer_endpoints[1]" in error["message"], error
        assert checked == []  # nothing reached the connector: no promise made
        for good in (["tcp://127.0.0.1:7001"], ["tcp://[::1]:7001", "tcp://d-0.kv.svc:7002"], ["ipc:///tmp/kv"]):
            kv = {"transfer_id": "t", "role": "prefill", "peer_endpoints": good}
            resp = await server.client.post("/v1/completions", json={"prompt": "a", "kv_transfer_params": kv})
            assert resp.status == 200, await resp.text()
        assert len(checked) == 3

    run_with_fake_server(body)
