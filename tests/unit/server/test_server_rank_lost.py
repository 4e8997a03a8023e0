"""A lost tensor-parallel rank (decision 085), server side, with a fake engine: in-flight requests
fail with 503 ``instance_lost`` (in-band for a started stream), the owner is told first (``on_lost``),
the engine thread stops, new requests and /health get 503 naming the rank; a rank lost while idle is
found by the idle check. Router side: such a 503 takes the instance out of routing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvwire.errors import INSTANCE_LOST, INSTANCE_STOPPING, RankLost
from kvwire.router.relay import _says_gone
from support.fake_engine_server import FakeEngine, FakeServer, start_fake_server, stop_fake_server, wait_until

LONG = 5000
LOST = "tensor-parallel rank 1 of 2 exited (code -9)"


class LosingEngine(FakeEngine):
    """Loses a rank on demand: in a step (``lose_in_step``) or to the idle check (``lose_idle``)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_model_len = 10_000
        self.step_delay_s = 0.002
        self.lose_in_step = False
        self.lose_idle = False

    def step(self) -> list[Any]:
        if self.lose_in_step:
            self.reqs.clear()  # the real engine ends every request and frees everything
            raise RankLost(LOST)
        return super().step()

    def check_ranks(self) -> None:
        if self.lose_idle:
            raise RankLost(LOST)


def _run(engine: LosingEngine, body: Any) -> list[RankLost]:
    told: list[RankLost] = []

    async def main() -> None:
        server = await start_fake_server(engine, on_lost=told.append)
        try:
            await asyncio.wait_for(body(server, told), timeout=30)
        finally:
            await stop_fake_server(server)

    asyncio.run(main())
    return told


def _assert_lost(error: dict[str, Any]) -> None:
    assert error["reason"] == INSTANCE_LOST and error["code"] == 503 and LOST in error["message"], error


def test_in_flight_requests_fail_with_503_instance_lost_and_the_owner_is_told() -> None:
    engine = LosingEngine()

    async def body(server: FakeServer, told: list[RankLost]) -> None:
        client = server.client
        req = {"prompt": "a", "max_tokens": LONG, "stream": True}
        streaming = await client.post("/v1/completions", json=req)
        assert streaming.status == 200
        assert (await streaming.content.readline()).startswith(b"data: ")
        plain = asyncio.create_task(client.post("/v1/completions", json={"prompt": "b", "max_tokens": LONG}))
        await wait_until(lambda: len(engine.reqs) == 2)
        engine.lose_in_step = True
        answer = await plain
        assert answer.status == 503
        _assert_lost((await answer.json())["error"])
        events = [line for line in (await streaming.read()).decode().split("\n\n") if line]
        _assert_lost(json.loads(events[-2].removeprefix("data: "))["error"])  # then [DONE]
        assert events[-1] == "data: [DONE]"
        assert len(told) == 1 and str(told[0]) == LOST
        await wait_until(lambda: not server.engine_loop.alive)
        later = await client.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
        assert later.status == 503
        _assert_lost((await later.json())["error"])
        health = await client.get("/health")
        assert health.status == 503 and LOST in (await health.json())["reason"]

    assert len(_run(engine, body)) == 1


def test_a_rank_lost_while_idle_is_found_by_the_idle_check() -> None:
    engine = LosingEngine()

    async def body(server: FakeServer, told: list[RankLost]) -> None:
        ok = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert ok.status == 200
        engine.lose_idle = True
        await wait_until(lambda: bool(told), timeout_s=5.0)  # RANK_CHECK_S is 1 s
        assert not server.engine_loop.alive

    _run(engine, body)


def test_the_router_takes_an_instance_saying_it_is_gone_out_of_routing() -> None:
    def body(code: str) -> bytes:
        return json.dumps({"error": {"message": "x", "type": "server_error", "code": code}}).encode()

    assert _says_gone(503, body(INSTANCE_LOST)) and _says_gone(503, body(INSTANCE_STOPPING))
    assert not _says_gone(503, body("engine_stalled"))  # a stall passes: the instance stays
    assert not _says_gone(500, body(INSTANCE_LOST))
    assert not _says_gone(503, b"not json") and not _says_gone(503, b"[1]") and not _says_gone(503, b"")
