"""Engine stall watchdog: an engine step that hangs (a stuck GPU op, here a step blocked on a
threading.Event) fails the requests waiting for it with 503 after ``engine_stall_timeout_s``, turns
/health and /metrics unhealthy, and the server serves again once the step returns. Idle time and long
but progressing work never count as a stall."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvwire.errors import ConfigError, EngineStalled
from kvwire.server.cli import add_arguments, server_config_from_args
from kvwire.server.config import ServerConfig
from kvwire.server.engine_loop import EngineHealth, EngineLoop
from kvwire.server.stall_watchdog import StallWatchdog
from support.fake_engine_server import (
    FakeEngine,
    FakeServer,
    sse_payloads,
    start_fake_server,
    stop_fake_server,
    wait_until,
)

STALL_S = 0.5
LONG = 5000  # tokens: a streaming request that runs for as long as the test needs it


def _run(engine: FakeEngine, body: Callable[[FakeServer], Any], stall_timeout_s: float = STALL_S) -> None:
    async def main() -> None:
        server = await start_fake_server(engine, engine_stall_timeout_s=stall_timeout_s)
        try:
            await asyncio.wait_for(body(server), timeout=30)
        finally:
            if engine.step_gate is not None:
                engine.step_gate.set()  # so the engine thread can stop
            await stop_fake_server(server)

    asyncio.run(main())


async def _metric(server: FakeServer, line_start: str) -> float:
    text = await (await server.client.get("/metrics")).text()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    assert len(values) == 1, (line_start, text)
    return values[0]


def _assert_stalled_error(body: dict[str, Any]) -> None:
    err = body["error"]
    assert err["type"] == "server_error" and err["reason"] == "engine_stalled" and err["code"] == 503, err
    assert "the engine stalled: no engine step completed" in err["message"]


def test_stalled_step_fails_in_flight_requests_with_503_then_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvwire.server.stall_watchdog")
    engine = FakeEngine()
    engine.max_model_len = 10_000
    engine.step_delay_s = 0.002

    async def body(server: FakeServer) -> None:
        client = server.client
        # A streaming request (admitted, first tokens sent) and a non-streaming one, both in the engine.
        req = {"prompt": "a", "max_tokens": LONG, "stream": True}
        streaming = await client.post("/v1/completions", json=req)
        assert streaming.status == 200
        first_event = await streaming.content.readline()
        assert first_event.startswith(b"data: ")
        plain = asyncio.create_task(client.post("/v1/completions", json={"prompt": "b", "max_tokens": LONG}))
        await wait_until(lambda: len(engine.reqs) == 2)
        engine.step_gate = threading.Event()  # the next step hangs
        await wait_until(engine.step_blocked.is_set)
        # A third request reaches the hung engine thread's queue and is never taken.
        queued = asyncio.create_task(client.post("/v1/completions", json={"prompt": "c", "max_tokens": 2}))

        resp = await plain
        assert resp.status == 503
        _assert_stalled_error(await resp.json())
        resp = await queued
        assert resp.status == 503
        _assert_stalled_error(await resp.json())
        events = sse_payloads(first_event + await streaming.read())  # ends: error event, [DONE]
        assert events[-1] == "[DONE]"
        _assert_stalled_error(json.loads(events[-2]))
        assert all("error" not in json.loads(e) for e in events[:-2])

        health = await client.get("/health")
        assert health.status == 503
        health_body = await health.json()
        assert health_body["status"] == "engine stalled"
        assert "no engine step completed" in health_body["reason"]
        resp = await client.post("/v1/completions", json={"prompt": "d", "max_tokens": 2})
        assert resp.status == 503  # refused at once while stalled
        _assert_stalled_error(await resp.json())
        assert await _metric(server, "kvwire_engine_stalled ") == 1.0
        assert await _metric(server, "kvwire_engine_stalls_total ") == 1.0
        assert await _metric(server, 'kvwire_requests_total{endpoint="completion",outcome="stalled"}') == 4.0
        assert server.engine_loop.num_streams == 0

        engine.step_gate.set()  # the stuck op returns: the engine thread resumes
        await wait_until(lambda: server.engine_loop.status().health is EngineHealth.OK)
        await wait_until(lambda: not engine.reqs)  # the failed requests were aborted in the engine
        assert len(engine.aborted) >= 2 and server.engine_loop.stats.kv_blocks_in_use == 0
        assert (await client.get("/health")).status == 200
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "bcd"
        assert await _metric(server, "kvwire_engine_stalled ") == 0.0
        assert await _metric(server, "kvwire_engine_stalls_total ") == 1.0

    _run(engine, body)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failing them with 503" in m for m in messages) == 1, messages  # logged once
    assert sum("the engine recovered" in m for m in messages) == 1, messages


def test_idle_and_slow_but_progressing_engine_is_not_a_stall() -> None:
    engine = FakeEngine()
    engine.step_delay_s = 0.05  # each step well under the stall timeout

    async def body(server: FakeServer) -> None:
        # The scenario, not a synchronization: the server idles for longer than the stall timeout.
        await asyncio.sleep(3 * STALL_S)
        # ~20 steps of 50 ms: the request takes several stall timeouts, making progress all along.
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 20})
        assert resp.status == 200, await resp.text()
        assert len((await resp.json())["choices"][0]["text"]) == 20
        assert (await server.client.get("/health")).status == 200
        assert server.engine_loop.status().num_stalls == 0
        assert await _metric(server, "kvwire_engine_stalls_total ") == 0.0

    _run(engine, body, stall_timeout_s=0.3)


class _Clock:
    """The watchdog's inputs, set by the test: the engine thread's last stamp and requests in flight."""

    def __init__(self) -> None:
        self.progress_s = 0.0
        self.busy = False
        self.stalls: list[EngineStalled] = []

    def watchdog(self, timeout_s: float = 10.0) -> StallWatchdog:
        return StallWatchdog(timeout_s, lambda: self.progress_s, lambda: self.busy, self.stalls.append)


def test_watchdog_states() -> None:
    c = _Clock()
    dog = c.watchdog()
    assert not dog.check(now_s=100.0)  # idle: an old stamp is no stall without requests
    c.busy = True
    c.progress_s = 95.0
    assert not dog.check(now_s=100.0)  # busy, stamp 5 s old
    assert dog.check(now_s=105.0) and dog.stalled  # 10 s old: declared
    assert len(c.stalls) == 1 and "for 10.0 s (limit 10 s)" in str(c.stalls[0])
    assert dog.check(now_s=200.0) and len(c.stalls) == 1 and dog.num_stalls == 1  # declared once
    c.busy = False
    assert dog.check(now_s=300.0)  # nothing in flight any more, still stalled until the engine moves
    c.progress_s = 301.0
    assert not dog.check(now_s=301.5) and not dog.stalled  # it moved: recovered
    c.busy = True
    assert dog.check(now_s=311.0) and dog.num_stalls == 2 and len(c.stalls) == 2  # a new stall


def test_watchdog_checks_periodically_and_stops() -> None:
    c = _Clock()
    c.busy = True
    dog = c.watchdog(timeout_s=0.05)

    async def main() -> None:
        dog.start(asyncio.get_running_loop())
        await wait_until(lambda: dog.stalled)  # the stamp (0.0) is ancient: the first check declares
        dog.stop()
        dog.stop()  # idempotent

    asyncio.run(main())
    assert len(c.stalls) == 1


def test_stall_timeout_is_configurable_and_validated() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert server_config_from_args(parser.parse_args([])).engine_stall_timeout_s == 120.0
    args = parser.parse_args(["--engine-stall-timeout-s", "2.5"])
    assert server_config_from_args(args).engine_stall_timeout_s == 2.5
    off = server_config_from_args(parser.parse_args(["--engine-stall-timeout-s", "0"]))
    assert off.engine_stall_timeout_s == 0
    assert ServerConfig(engine_stall_timeout_s=None).engine_stall_timeout_s is None
    with pytest.raises(ConfigError, match="engine_stall_timeout_s"):
        ServerConfig(engine_stall_timeout_s=-1)
    with pytest.raises(ConfigError, match="stall timeout"):
        StallWatchdog(0, lambda: 0.0, lambda: False, lambda e: None)
    assert EngineLoop(FakeEngine(), stall_timeout_s=off.engine_stall_timeout_s).stall_timeout_s is None  # off
    assert EngineLoop(FakeEngine(), stall_timeout_s=None).stall_timeout_s is None
    assert EngineLoop(FakeEngine(), stall_timeout_s=2.5).stall_timeout_s == 2.5
