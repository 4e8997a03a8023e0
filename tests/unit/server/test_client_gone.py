"""A client that goes away mid-request is a routine event on both front doors (instance and router):
logged at debug level, never as an error with a traceback (``kvwire.http.front_door.client_gone``);
and a request that never reaches the engine withdraws its kv_transfer_params (P's promise to D).

With ``handler_cancellation`` a lost connection usually cancels the handler; but a read or a write
that meets the closed connection first raises ``ConnectionResetError`` in the handler (the body read
as its task completes, a write to a closing transport). Both front doors' body reads are made to
raise it here, as they do then."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from kvwire.errors import InvalidRequestError
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
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


def test_a_request_the_engine_refuses_withdraws_its_kv_params() -> None:
    """P's promise to D is made when the request's kv_transfer_params pass the connector's check at
    HTTP admission; a request the engine then refuses never runs, so the handler withdraws them (D is
    told at once instead of waiting up to the promise's limit)."""
    withdrawn: list[tuple[str, str]] = []

    class Refusing(FakeEngine):
        def add_request(self, *args: object, **kwargs: object) -> None:
            raise InvalidRequestError("refused by the engine")

    params = KVTransferParams(transfer_id="t-refused", mode=TransferMode.PUSH, role=Role.PREFILL,
                              peer_endpoints=["tcp://127.0.0.1:9"])

    async def main() -> None:
        server = await start_fake_server(Refusing())
        try:
            server.generation._withdraw_kv = lambda p, why: withdrawn.append((p.transfer_id, why))
            body = {**BODY, "kv_transfer_params": params.to_dict()}
            resp = await server.client.post("/v1/completions", json=body)
            assert resp.status == 400
        finally:
            await stop_fake_server(server)

    asyncio.run(main())
    assert withdrawn == [("t-refused", "not admitted: InvalidRequestError")]
