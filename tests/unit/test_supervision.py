"""Supervised threads: restarted with backoff, dead after too many failures, never silent."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvwire.errors import ConfigError
from kvwire.supervision import (
    ComponentState,
    HealthBoard,
    RestartPolicy,
    SupervisedThread,
    SupervisionCollector,
    guarded,
)

FAST = RestartPolicy(max_restarts=3, window_s=60.0, backoff_initial_s=0.001, backoff_max_s=0.002)


def test_a_failing_body_is_restarted_and_the_component_stays_up() -> None:
    board = HealthBoard()
    stop = threading.Event()
    runs: list[int] = []
    recovered = threading.Event()

    def body() -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise RecursionError("hostile frame")
        recovered.set()
        stop.wait(10)

    thread = SupervisedThread("kvwire-test", body, stop, board=board, policy=FAST).start()
    assert recovered.wait(5)
    assert board.restarts() == {"kvwire-test": 2}
    assert board.dead() == []
    assert board.health_body() is None
    [status] = board.snapshot()
    assert status.state is ComponentState.RUNNING
    assert "RecursionError" in (status.last_error or "")
    assert thread.stop(5)
    assert board.snapshot() == []  # stopped on purpose: off the board
    assert board.restarts() == {"kvwire-test": 2}  # the count outlives it


def test_too_many_failures_make_the_component_dead_and_call_on_dead() -> None:
    board = HealthBoard()
    stop = threading.Event()
    dead_with: list[BaseException] = []
    gave_up = threading.Event()

    def body() -> None:
        raise ValueError("always")

    def on_dead(exc: BaseException) -> None:
        dead_with.append(exc)
        gave_up.set()

    thread = SupervisedThread("kvwire-doomed", body, stop, board=board, policy=FAST, on_dead=on_dead).start()
    assert gave_up.wait(5)
    thread.join(5)
    assert not thread.is_alive()
    [dead] = board.dead()
    assert dead.name == "kvwire-doomed"
    assert dead.restarts == FAST.max_restarts
    assert isinstance(dead_with[0], ValueError)
    body_503 = board.health_body()
    assert body_503 is not None
    assert "kvwire-doomed" in str(body_503["reason"])


def test_a_body_that_returns_while_not_stopping_counts_as_a_failure() -> None:
    board = HealthBoard()
    stop = threading.Event()
    calls: list[int] = []
    second = threading.Event()

    def body() -> None:
        calls.append(1)
        if len(calls) == 1:
            return  # silent exit: not allowed
        second.set()
        stop.wait(10)

    thread = SupervisedThread("kvwire-quitter", body, stop, board=board, policy=FAST).start()
    assert second.wait(5)
    assert board.restarts() == {"kvwire-quitter": 1}
    assert "returned while not stopping" in (board.snapshot()[0].last_error or "")
    assert thread.stop(5)


def test_failures_outside_the_window_do_not_add_up() -> None:
    board = HealthBoard()
    key = board.register("c")
    policy = RestartPolicy(max_restarts=1, window_s=1e-9)
    for _ in range(5):
        assert board.failed(key, "x", policy) is ComponentState.RESTARTING


def test_guarded_worker_errors_are_counted_and_exported() -> None:
    board = HealthBoard()
    SupervisedThread("kvwire-up", lambda: None, threading.Event(), board=board)  # not started: not listed

    def boom(_conn: object) -> None:
        raise OSError("reset")

    worker = threading.Thread(target=guarded("kvwire-tcp-recv", boom, board), args=(object(),))
    worker.start()
    worker.join(5)
    assert board.worker_errors() == {"kvwire-tcp-recv": 1}
    key = board.register("kvwire-discovery")
    board.mark_dead(key, "socket closed")
    registry = CollectorRegistry()
    registry.register(SupervisionCollector(board))
    text = generate_latest(registry).decode()
    assert 'kvwire_thread_errors_total{component="kvwire-tcp-recv"} 1.0' in text
    assert 'kvwire_component_up{component="kvwire-discovery"} 0.0' in text


def test_restart_policy_is_validated() -> None:
    with pytest.raises(ConfigError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ConfigError):
        RestartPolicy(backoff_initial_s=2.0, backoff_max_s=1.0)
    assert RestartPolicy(backoff_initial_s=0.1, backoff_max_s=0.3).backoff_s(5) == pytest.approx(0.3)
