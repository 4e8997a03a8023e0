"""A client that goes away at the moment its request is admitted: the cancellation of the handler is
never lost, so the engine always gets the request's abort.

The race (2P2D push, `test_client_aborts_mid_handover_release_blocks`): the router cancels its calls
to P and D; D's aiohttp handler is cancelled (the connection is gone) in the very loop iteration in
which the engine thread took the request. Python 3.10/3.11's ``asyncio.wait_for`` then returns the
inner result instead of raising ``CancelledError`` (CPython gh-86296), the non-streaming handler goes
on to wait for an answer nobody reads, and nothing aborts the request: D keeps its KV blocks while it
waits for a transfer its P never heard of (up to ``max_admission_wait_s``). The body read of both
front doors (instance and router) had the same flaw. Each test places the cancellation at every point
of the hand-over, one loop callback apart (asyncio runs ready callbacks in order, so every placement
is reproduced exactly); with ``asyncio.wait_for`` 3 of 12 placements lose it (decision 146)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvwire.engine import SamplingParams
from kvwire.engine.outputs import RequestOutput
from kvwire.errors import InvalidRequestError
from kvwire.router.app import RouterServer
from kvwire.router.config import RouterConfig
from kvwire.server.engine_loop import EngineLoop, RequestOutbox
from kvwire.server.generate import GenerationHandler
from support.fake_engine_server import FakeEngine, wait_until

MAX_HOPS = 12  # loop callbacks between the completion and the cancellation (the hand-over takes < 6)


class _HeldEngine(FakeEngine):
    """Requests never progress (each step yields nothing): one ends only when it is aborted."""

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)  # the engine loop steps while a request is in it: do not spin
        return []


def _cancel_after(task: asyncio.Task[Any], hops: int, cancelled: list[bool]) -> None:
    """Cancel ``task`` once ``hops`` more ready callbacks ran; record whether it was still pending."""
    if hops == 0:
        cancelled.append(task.cancel())
        return
    asyncio.get_running_loop().call_soon(_cancel_after, task, hops - 1, cancelled)


async def _outcome(task: asyncio.Task[Any], cancelled: list[bool]) -> tuple[bool, str]:
    """(whether the cancellation came while ``task`` was pending, how ``task`` ended)."""
    try:
        await task
        outcome = "returned"
    except asyncio.CancelledError:
        outcome = "cancelled"
    for _ in range(MAX_HOPS + 1):  # the task may have ended before the cancellation was placed
        if cancelled:
            break
        await asyncio.sleep(0)
    assert len(cancelled) == 1
    return cancelled[0], outcome


@pytest.mark.parametrize("hops", range(MAX_HOPS))
def test_a_cancel_while_the_engine_takes_the_request_aborts_it(hops: int) -> None:
    """EngineLoop.add_request cancelled ``hops`` callbacks after the engine thread took the request:
    either the cancellation reaches the caller (and the engine gets the abort), or add_request had
    already returned when it came; never both pending and lost."""
    engine = _HeldEngine()

    async def main() -> None:
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            outbox: RequestOutbox = asyncio.Queue()
            task = asyncio.create_task(loop.add_request("r", outbox, [1, 2], SamplingParams(max_tokens=8)))
            await asyncio.sleep(0)  # the command is queued; the task waits for the engine thread
            # Block the event loop until the engine thread resolved the add: its result is then the
            # next ready callback, and the cancellation is placed ``hops`` callbacks after it.
            added = loop._adding["r"]
            concurrent.futures.wait([added], timeout=10.0)
            assert added.done(), "the engine thread did not take the request"
            cancelled: list[bool] = []
            _cancel_after(task, hops, cancelled)
            pending, outcome = await _outcome(task, cancelled)
            if pending:  # the cancellation came while add_request was pending
                assert outcome == "cancelled", f"cancel {hops} callbacks after the add was lost"
                await wait_until(lambda: "r" in engine.aborted, timeout_s=10.0)
            else:
                assert outcome == "returned"
                assert "r" in engine.reqs and not engine.aborted
        finally:
            assert loop.close(5.0)

    asyncio.run(main())


class _Request:
    """The part of an aiohttp request the body reads use: ``read`` completes when the test says."""

    content_length = None

    def __init__(self) -> None:
        self.body: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def read(self) -> bytes:
        return await self.body


def _server_read(timeout_s: float) -> Callable[[_Request], Awaitable[bytes]]:
    handler = GenerationHandler(None, None, None, "m", 64,  # type: ignore[arg-type]  # reads only
                                accepts_kv_transfer_params=False, body_timeout_s=timeout_s)
    return handler.read_body  # type: ignore[return-value]


def _router_read(timeout_s: float) -> Callable[[_Request], Awaitable[bytes]]:
    router = SimpleNamespace(cfg=RouterConfig(port=0, discovery_port=0, http_body_timeout_s=timeout_s))
    return functools.partial(RouterServer._read_body, router)  # type: ignore[arg-type]  # reads cfg only


FRONT_DOORS = {"server": _server_read, "router": _router_read}


@pytest.mark.parametrize("door", sorted(FRONT_DOORS))
@pytest.mark.parametrize("hops", range(MAX_HOPS))
def test_a_cancel_as_the_body_arrives_is_not_lost(door: str, hops: int) -> None:
    """The body's last bytes and the connection loss in one loop iteration: the handler's
    cancellation propagates (``asyncio.wait_for`` would return the body), at every placement."""

    async def main() -> None:
        request = _Request()
        task = asyncio.ensure_future(FRONT_DOORS[door](30.0)(request))
        await asyncio.sleep(0)  # reading
        request.body.set_result(b"{}")
        cancelled: list[bool] = []
        _cancel_after(task, hops, cancelled)
        pending, outcome = await _outcome(task, cancelled)
        assert outcome == ("cancelled" if pending else "returned")

    asyncio.run(main())


@pytest.mark.parametrize("door", sorted(FRONT_DOORS))
def test_a_body_read_past_its_deadline_fails_and_stops(door: str) -> None:
    async def main() -> None:
        request = _Request()
        with pytest.raises(asyncio.TimeoutError if door == "server" else InvalidRequestError,
                           match=r"within 0\.05 s"):
            await FRONT_DOORS[door](0.05)(request)
        await asyncio.sleep(0)
        assert request.body.cancelled()  # the read does not outlive the deadline

    asyncio.run(main())


@pytest.mark.parametrize("door", sorted(FRONT_DOORS))
def test_a_body_read_returns_the_body_or_raises_what_the_read_raised(door: str) -> None:
    async def main() -> None:
        request = _Request()
        request.body.set_result(b"body")
        assert await FRONT_DOORS[door](1.0)(request) == b"body"
        failing = _Request()
        failing.body.set_exception(ConnectionResetError("Connection lost"))
        with pytest.raises(ConnectionResetError):
            await FRONT_DOORS[door](1.0)(failing)

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death
def test_an_add_taken_by_an_engine_thread_that_died_fails_within_the_liveness_check() -> None:
    """The engine thread took the add and died before answering it (nothing left in the queue for
    ``_refuse_pending``): the admission still ends with an EngineError, not a wait without end."""

    class _Dies(_HeldEngine):
        def add_request(self, *args: Any, **kwargs: Any) -> None:
            raise SystemExit  # ends the engine thread at once, the add unanswered

    async def main() -> None:
        loop = EngineLoop(_Dies())
        loop.start(asyncio.get_running_loop())
        try:
            outbox: RequestOutbox = asyncio.Queue()
            with pytest.raises(Exception, match="not running"):
                await asyncio.wait_for(
                    loop.add_request("r", outbox, [1, 2], SamplingParams(max_tokens=8)), timeout=20.0
                )
        finally:
            loop.close(5.0)

    asyncio.run(main())
