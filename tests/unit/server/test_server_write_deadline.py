"""A client that stops reading (connection left open) is cut off after the write deadline: a streaming
request is aborted in the engine (blocks freed), a non-streaming body is abandoned; either way the
request counts as ``client_timeout`` and the server keeps serving others."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvwire.engine.outputs import RequestOutput
from kvwire.errors import ConfigError
from kvwire.server.cli import add_arguments, server_config_from_args
from kvwire.server.config import ServerConfig
from support.fake_engine_server import FakeEngine, FakeServer, start_fake_server, stop_fake_server
from support.http_client import read_slowly

CHUNK_CHARS = 32 * 1024  # text per generated token: the socket buffers fill after a few dozen events
WRITE_TIMEOUT_S = 0.5


class BigChunkEngine(FakeEngine):
    """Like FakeEngine, but every output carries CHUNK_CHARS of text, and the model is long enough to
    keep a request running well past the write deadline."""

    max_model_len = 100_000

    def _advance(self, request_id: str) -> RequestOutput:
        out = super()._advance(request_id)
        out.new_text = out.new_text * CHUNK_CHARS
        return out


async def _wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)


class BigBodyEngine(FakeEngine):
    """Like FakeEngine, but the finished output's text is CHUNK_CHARS per token: a non-streaming body
    far larger than the socket buffers (4 MiB at most on Linux) plus aiohttp's write buffer."""

    max_model_len = 100_000

    def _advance(self, request_id: str) -> RequestOutput:
        out = super()._advance(request_id)
        if out.finished:
            out.text = out.text * CHUNK_CHARS
        return out


async def _requests_counted(server: FakeServer) -> dict[str, float]:
    """outcome -> count of kvwire_requests_total for the completion endpoint."""
    text = await (await server.client.get("/metrics")).text()
    prefix = 'kvwire_requests_total{endpoint="completion",outcome="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def _stalled_client(server: FakeServer, body: dict[str, Any]) -> socket.socket:
    """Send a request over a socket with a tiny receive buffer that is then never read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.settimeout(5)
    sock.connect((server.client.host, server.client.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def _run_with_server(engine: FakeEngine, body: Callable[[FakeServer], Awaitable[None]]) -> None:
    """Start a fake server on ``engine`` with the test's write deadline, run ``body`` (30 s bound), stop."""

    async def main() -> None:
        server = await start_fake_server(engine, client_write_timeout_s=WRITE_TIMEOUT_S)
        try:
            await asyncio.wait_for(body(server), timeout=30)
        finally:
            await stop_fake_server(server)

    asyncio.run(main())


def test_stalled_streaming_client_is_cut_off_and_its_request_aborted() -> None:
    engine = BigChunkEngine()
    engine.step_delay_s = 0.005  # ~200 tokens/s: the request would run for 50 s

    async def body(server: FakeServer) -> None:
        sock = _stalled_client(server, {"prompt": "abc", "max_tokens": 10_000, "stream": True})
        try:
            await _wait_until(lambda: bool(engine.reqs), 5, "the request to start")
            started = time.monotonic()
            # Without a write deadline the handler parks in drain() for ever and nothing is aborted.
            await _wait_until(lambda: engine.aborted != [] and server.engine_loop.stats.kv_blocks_in_use == 0,
                              10, "the stalled request to be aborted")
            assert time.monotonic() - started < 8
            assert not engine.reqs and server.engine_loop.num_streams == 0
            resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3,
                                                                     "stream": True})
            assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
            text = await (await server.client.get("/metrics")).text()
            assert 'kvwire_requests_total{endpoint="completion",outcome="client_timeout"} 1.0' in text
            assert 'outcome="disconnect"' not in text
        finally:
            sock.close()

    _run_with_server(engine, body)


def test_non_streaming_client_that_does_not_read_its_body_is_cut_off() -> None:
    engine = BigBodyEngine()

    async def body(server: FakeServer) -> None:
        started = time.monotonic()
        sock = _stalled_client(server, {"prompt": "abc", "max_tokens": 512})  # a 16 MiB body
        try:
            deadline = started + 10
            # Without a write deadline aiohttp writes the body after the handler returned and waits in
            # drain() for ever; the request was counted "length" and nothing else happens.
            while (counted := await _requests_counted(server)) != {"client_timeout": 1.0}:
                assert time.monotonic() < deadline, f"the stalled client was not cut off: {counted}"
                await asyncio.sleep(0.05)
            assert time.monotonic() - started < 8
            assert not engine.reqs and server.engine_loop.num_streams == 0
            resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
            assert resp.status == 200 and len((await resp.json())["choices"][0]["text"]) == 3 * CHUNK_CHARS
            assert await _requests_counted(server) == {"client_timeout": 1.0, "length": 1.0}
        finally:
            sock.close()

    _run_with_server(engine, body)


def test_slow_reader_of_a_large_non_streaming_body_gets_all_of_it() -> None:
    engine = BigBodyEngine()

    async def body(server: FakeServer) -> None:
        sock = _stalled_client(server, {"prompt": "abc", "max_tokens": 512})  # a 16 MiB body
        sock.settimeout(20)
        try:
            # Each pause is shorter than the deadline, the whole read (over 1.6 s) much longer: the
            # deadline bounds one piece of the body, not the whole body.
            head, payload = await asyncio.to_thread(read_slowly, sock, WRITE_TIMEOUT_S / 5, 1 << 20)
        finally:
            sock.close()
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"Content-Type: application/json" in head
        text = json.loads(payload)["choices"][0]["text"]
        assert len(text) == 512 * CHUNK_CHARS
        assert await _requests_counted(server) == {"length": 1.0}

    _run_with_server(engine, body)


def test_write_timeout_is_configurable_and_validated() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--client-write-timeout-s", "2.5"])
    assert server_config_from_args(args).client_write_timeout_s == 2.5
    assert ServerConfig().client_write_timeout_s == 30.0
    with pytest.raises(ConfigError, match="client_write_timeout_s"):
        ServerConfig(client_write_timeout_s=0)
