"""A client that goes away mid-request is a routine event on both front doors (instance and router):
logged at debug level, never as an error with a traceback (``kvwire.http.front_door.client_gone``).

With ``handler_cancellation`` a lost connection usually cancels the handler; but a read or a write
that meets the closed connection first raises ``ConnectionResetError`` in the handler (the body read
as its task completes, a write to a closing transport). Both front doors' body reads are made to
raise it here, as they do then."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from kvwire.router.app import RouterServer
from kvwire.router.config import RouterConfig
from support.fake_engine_server import FakeEngine, start_fake_server, stop_fake_server

BODY = {"prompt": "a", "max_tokens": 3}


async def _gone(*_: object) -> bytes:
    raise ConnectionResetError("Connection lost")


async def _post(url: str) -> None:
    """The request; the front door closes the connection without a reply (499 in its access log)."""
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                await resp.read()


async def _instance() -> None:
    server = await start_fake_server(FakeEngine())
    try:
        server.generation.read_body = _gone  # type: ignore[method-assign]
        await _post(str(server.client.make_url("")).rstrip("/"))
    finally:
        await stop_fake_server(server)


async def _router() -> None:
    server = RouterServer(RouterConfig(port=0, discovery_port=0))
    await server.start()
    try:
        server._read_body = _gone  # type: ignore[method-assign]
        await _post(server.url)
        requests = server.metrics.requests.labels(endpoint="/v1/completions", outcome="client_disconnected")
        assert requests._value.get() == 1
    finally:
        await server.stop()


@pytest.mark.parametrize("door", ["instance", "router"])
def test_a_client_gone_mid_request_is_no_error(door: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        asyncio.run(_instance() if door == "instance" else _router())
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    assert any(r.name == "kvwire.http.front_door" and "client gone" in r.getMessage() for r in caplog.records)
