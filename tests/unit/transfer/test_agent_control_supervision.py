"""The transfer control loop under supervision (decision 116): what one message or one send raises is
contained and counted; a loop that keeps failing restarts with backoff, then is dead, and then every
transfer fails at once and new ones are refused (nothing waits on a dead agent)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import zmq

from kvwire.errors import TransferError
from kvwire.supervision import ComponentState, HealthBoard
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer import agent as control_module
from kvwire.transfer.agent import NAME
from kvwire.transfer.wire import Codec, Offer, Renew
from support.agent_helpers import _layers, _send, poll_until


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.01)


def test_agent_threads_are_on_the_given_board() -> None:
    board = HealthBoard()
    with TransferAgent(TransferConfig(), board=board) as agent:
        assert agent.board is board
        control = [s for s in board.snapshot() if s.name == NAME]  # beside the planes' (decision 115)
        assert len(control) == 1 and control[0].state is ComponentState.RUNNING
    assert board.snapshot() == []  # stopped on purpose: no longer counts for health


def test_a_message_whose_handling_raises_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    with TransferAgent(TransferConfig()) as a, TransferAgent(TransferConfig()) as b:
        real = b._receiver.on_offer
        calls = []

        def once_broken(msg: Offer) -> None:
            calls.append(msg.transfer_id)
            if len(calls) == 1:
                raise RuntimeError("a bug one message triggers")
            real(msg)

        monkeypatch.setattr(b._receiver, "on_offer", once_broken)
        layers = _layers(2)
        b.expect("first", num_layers=2, deadline_s=1.0)
        _send(a, "first", b.endpoint, layers, deadline_s=1.0)
        b.expect("second", num_layers=2)
        _send(a, "second", b.endpoint, layers)
        poll_until(b, lambda ev: "second" in ev["recvd"])
        assert torch.equal(b.take_layers("second")[1], layers[1])
        assert b.board.worker_errors() == {NAME: 1} and not b.board.dead()


def test_a_send_that_raises_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. an endpoint a peer named that ZeroMQ refuses at connect: that one message is dropped."""
    with TransferAgent(TransferConfig()) as agent, TransferAgent(TransferConfig()) as other:
        control = agent._core.control
        assert control is not None
        real = control._send_now
        failures: list[str] = []

        def first_fails(endpoint: str, msg: object) -> None:
            if not failures:
                failures.append(endpoint)
                raise zmq.ZMQError(zmq.EINVAL, "Invalid argument")
            real(endpoint, msg)  # type: ignore[arg-type]

        monkeypatch.setattr(control, "_send_now", first_fails)
        layers = _layers(1)
        agent.expect("lost", num_layers=1, pull_from=other.endpoint, deadline_s=1.0)  # its Pull is dropped
        wait_for(lambda: agent.board.worker_errors().get(NAME, 0) == 1, "the failed send contained")
        agent.expect("after", num_layers=1)
        _send(other, "after", agent.endpoint, layers)
        poll_until(agent, lambda ev: "after" in ev["recvd"])
        assert failures == [other.endpoint] and not agent.board.dead()


def test_a_loop_that_keeps_failing_is_dead_and_fails_its_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    board = HealthBoard()
    agent = TransferAgent(TransferConfig(), board=board)
    try:
        agent.expect("waiting", num_layers=1, deadline_s=600.0)

        def broken(now: float) -> None:
            raise RuntimeError("deadline scan broken")

        monkeypatch.setattr(agent._sender, "renew", broken)  # raises on every tick
        wait_for(lambda: bool(board.dead()), "the control loop given up", timeout_s=60.0)
        dead = board.dead()[0]
        assert dead.name == NAME and "deadline scan broken" in (dead.last_error or "")
        assert board.restarts()[NAME] == 5  # restarted with backoff first (RestartPolicy default)
        events = poll_until(agent, lambda ev: "waiting" in ev["failed"])
        assert events["failed"]["waiting"].startswith("closed: the transfer control loop is dead")
        with pytest.raises(TransferError, match="control loop is dead"):
            agent.expect("new", num_layers=1)
        with pytest.raises(TransferError, match="control loop is dead"):
            agent.start_send("new", agent.endpoint, [])
        body = board.health_body()
        assert body is not None and NAME in str(body["reason"])
    finally:
        agent.close()  # still closes cleanly (the thread is gone)


def test_a_handler_that_keeps_failing_restarts_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control_module, "MAX_CONTAINED_ERRORS", 3)
    with TransferAgent(TransferConfig()) as agent, TransferAgent(TransferConfig()) as other:
        def broken(msg: object) -> None:
            raise RuntimeError("renew handling broken")

        monkeypatch.setattr(agent._routes, "_on_renew", broken)
        ctx = zmq.Context()
        out = ctx.socket(zmq.DEALER)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(agent.endpoint)
        try:
            for i in range(4):  # one more than tolerated
                renew = Renew(src_id="x", src_endpoint=other.endpoint, transfer_id=f"r{i}", state="unknown")
                out.send_multipart(Codec(None).encode(renew))
            wait_for(lambda: agent.board.restarts().get(NAME) == 1, "the loop restarted")
        finally:
            out.close(0)
            ctx.term()
        assert agent.board.worker_errors()[NAME] == 4 and not agent.board.dead()
        monkeypatch.undo()
        layers = _layers(1)  # the restarted loop serves transfers
        agent.expect("after", num_layers=1)
        _send(other, "after", agent.endpoint, layers)
        poll_until(agent, lambda ev: "after" in ev["recvd"])
