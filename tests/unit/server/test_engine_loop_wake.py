"""The engine loop steps as soon as a KV transfer ends, not at the end of its poll wait (decision
153): with only remote-KV waiters the loop blocks on its command queue for ``remote_wait_s``; the
transfer agent's completion calls ``EngineLoop.wake``, which ends that wait at once. Checked by
order, not time: the poll wait is set far longer than the test's deadline, so only a wake steps.
When the agent wakes the loop and no blocks wait for a send, the poll is ``receive_wait_s`` instead
(decision 158). A step that finishes a request whose blocks wait for a send is followed by a step once
its outputs reached their outbox (decision 161)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import torch

from kvwire.server.connectors import ConnectorSet
from kvwire.server.engine_loop import EngineLoop, RequestOutbox
from kvwire.transfer import TransferAgent, TransferConfig
from support.agent_helpers import _send, poll_until

NEVER_S = 600.0  # the loop's poll wait: far beyond every deadline below
DEADLINE_S = 30.0


class _RemoteWaiterEngine:
    """One request that only waits for remote KV: nothing running or waiting; each step counted."""

    def __init__(self, delayed_free: int = 0) -> None:
        self.unfinished = False
        self.delayed_free = delayed_free  # finished requests holding blocks for a send
        self.steps = 0
        self.stepped = threading.Condition()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    kv_transfer_params: Any = None) -> None:
        self.unfinished = True

    def abort_request(self, request_id: str) -> None:
        self.unfinished = False

    def step(self) -> list[Any]:
        with self.stepped:
            self.steps += 1
            self.stepped.notify_all()
        return []

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def stats(self) -> Any:
        return SimpleNamespace(num_running=0, num_waiting=0, num_waiting_for_remote_kv=int(self.unfinished),
                               num_delayed_free_requests=self.delayed_free)

    def wait_steps(self, count: int, timeout_s: float = DEADLINE_S) -> bool:
        with self.stepped:
            return self.stepped.wait_for(lambda: self.steps >= count, timeout_s)


def _run_with_waiter(
    body: Any, engine: _RemoteWaiterEngine | None = None, remote_wait_s: float = NEVER_S,
    receive_wait_s: float = NEVER_S, wakes_on_receive: bool = False,
) -> _RemoteWaiterEngine:
    """Start a loop polling every NEVER_S (or as given), admit one remote waiter, wait for the step
    after the admission, then run ``body(loop, engine)`` on a worker thread."""
    engine = engine or _RemoteWaiterEngine()

    async def main() -> None:
        loop = EngineLoop(engine, remote_wait_s=remote_wait_s, receive_wait_s=receive_wait_s,
                          idle_wait_s=NEVER_S)
        loop.wakes_on_receive = wakes_on_receive
        loop.start(asyncio.get_running_loop())
        try:
            outbox: RequestOutbox = asyncio.Queue()
            await loop.add_request("r", outbox, [1, 2, 3], None)
            assert await asyncio.to_thread(engine.wait_steps, 1), "the admission is followed by a step"
            await asyncio.to_thread(body, loop, engine)
        finally:
            assert await asyncio.to_thread(loop.close, DEADLINE_S)

    asyncio.run(main())
    return engine


def test_a_wake_ends_the_poll_wait_at_once() -> None:
    def body(loop: EngineLoop, engine: _RemoteWaiterEngine) -> None:
        steps = engine.steps
        loop.wake()
        assert engine.wait_steps(steps + 1), "the loop stepped only at its poll deadline"

    _run_with_waiter(body)


def test_wakes_that_pile_up_queue_one_command() -> None:
    """A burst of completions while the engine is busy costs one queued wake, not one each."""
    def body(loop: EngineLoop, engine: _RemoteWaiterEngine) -> None:
        steps = engine.steps
        with engine.stepped:  # the engine thread is blocked in (or before) the queue wait
            for _ in range(100):
                loop.wake()
            assert loop._commands.qsize() <= 1
        assert engine.wait_steps(steps + 1)

    _run_with_waiter(body)


def test_a_received_transfer_wakes_the_loop_through_the_connector_set() -> None:
    """The wiring the server does (``ConnectorSet.wake_on_transfer_end``) on a real agent pair: a
    receive that completes calls the wake; one that fails does too."""
    woken = threading.Semaphore(0)
    with TransferAgent(TransferConfig()) as p, TransferAgent(TransferConfig()) as d:
        ConnectorSet(worker=SimpleNamespace(agent=d)).wake_on_transfer_end(woken.release)
        d.expect("ok", num_layers=1)
        _send(p, "ok", d.endpoint, [torch.randn(2, 4, 8)])
        poll_until(d, lambda ev: "ok" in ev["recvd"])
        assert woken.acquire(timeout=DEADLINE_S)
        d.expect("gone", num_layers=1)
        d.abort("gone", "test")
        poll_until(d, lambda ev: "gone" in ev["failed"])
        assert woken.acquire(timeout=DEADLINE_S)


def test_a_loop_the_agent_wakes_polls_slowly_while_only_receives_are_awaited() -> None:
    """Decision 158: the 2 ms poll gives way to ``receive_wait_s`` (here NEVER_S) once a receive's
    end wakes the loop; a wake still steps at once."""
    def body(loop: EngineLoop, engine: _RemoteWaiterEngine) -> None:
        steps = engine.steps
        # 0.3 s: ~150 polls of remote_wait_s, had it been used (a loaded box only makes fewer)
        assert not engine.wait_steps(steps + 1, timeout_s=0.3), "the loop polled at remote_wait_s"
        loop.wake()
        assert engine.wait_steps(steps + 1)

    _run_with_waiter(body, remote_wait_s=0.002, wakes_on_receive=True)


def test_the_loop_keeps_polling_while_blocks_wait_for_a_send() -> None:
    """P's held push starts at its next step and a send's end does not wake the loop: with blocks
    held for a send the poll stays ``remote_wait_s`` even when receives wake it."""
    def body(loop: EngineLoop, engine: _RemoteWaiterEngine) -> None:
        assert engine.wait_steps(engine.steps + 3), "no poll while blocks waited for a send"

    _run_with_waiter(body, _RemoteWaiterEngine(delayed_free=1), remote_wait_s=0.002, wakes_on_receive=True)


def test_a_loop_nothing_wakes_keeps_polling() -> None:
    def body(loop: EngineLoop, engine: _RemoteWaiterEngine) -> None:
        assert engine.wait_steps(engine.steps + 3), "no poll without the agent's wakes"

    _run_with_waiter(body, remote_wait_s=0.002, wakes_on_receive=False)


def test_the_connector_set_says_whether_the_agent_wakes_the_loop() -> None:
    assert not ConnectorSet(worker=SimpleNamespace()).wake_on_transfer_end(lambda: None)
    with TransferAgent(TransferConfig()) as d:
        assert ConnectorSet(worker=SimpleNamespace(agent=d)).wake_on_transfer_end(lambda: None)


class _FinishingEngine(_RemoteWaiterEngine):
    """P's shape: the step after the admission finishes the request and holds its blocks for a send
    (``finish_holds``); each step records how many outputs the request's outbox held when it ran."""

    def __init__(self, finish_holds: bool) -> None:
        super().__init__()
        self.finish_holds = finish_holds
        self.outbox: RequestOutbox | None = None
        self.seen: list[int] = []

    def step(self) -> list[Any]:
        assert self.outbox is not None
        self.seen.append(self.outbox.qsize())
        finishing = self.steps == 0
        if finishing:
            self.delayed_free = int(self.finish_holds)
        out = [SimpleNamespace(request_id="r", finished=True)] if finishing else []
        super().step()
        return out


def _run_finishing(engine: _FinishingEngine, body: Any) -> None:
    async def main() -> None:
        loop = EngineLoop(engine, remote_wait_s=NEVER_S, receive_wait_s=NEVER_S, idle_wait_s=NEVER_S)
        loop.start(asyncio.get_running_loop())
        try:
            engine.outbox = asyncio.Queue()
            await loop.add_request("r", engine.outbox, [1, 2, 3], None)
            await asyncio.to_thread(body, engine)
        finally:
            assert await asyncio.to_thread(loop.close, DEADLINE_S)

    asyncio.run(main())


def test_a_request_finished_with_a_send_held_wakes_the_loop_after_its_outputs() -> None:
    """Decision 161: the poll is NEVER_S, so only the wake that follows the delivery steps again;
    that step sees the finished output already in its outbox (the writers ran first)."""
    def body(engine: _FinishingEngine) -> None:
        assert engine.wait_steps(2), "the held send waited for the poll"
        assert engine.seen[:2] == [0, 1]

    _run_finishing(_FinishingEngine(finish_holds=True), body)


def test_a_request_finished_without_a_send_does_not_wake_the_loop() -> None:
    def body(engine: _FinishingEngine) -> None:
        assert engine.wait_steps(1)
        # 0.3 s: a wake would step at once (a loaded box only delays it)
        assert not engine.wait_steps(2, timeout_s=0.3), "a step with nothing held was woken"

    _run_finishing(_FinishingEngine(finish_holds=False), body)
