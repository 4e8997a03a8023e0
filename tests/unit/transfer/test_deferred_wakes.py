"""Core.wakes_deferred (decision 162): a thread's wakes of the control thread wait for its block's end."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.core import CompletionEvents, Core


class Waker:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


def make_core() -> tuple[Core, Waker]:
    plane: Any = None
    memory: Any = None
    core = Core(TransferConfig(), "me", plane, memory, CompletionEvents())
    waker = Waker()
    control: Any = types.SimpleNamespace(waker=waker)
    core.control = control
    return core, waker


def test_wakes_in_the_block_become_one_wake_at_its_end() -> None:
    core, waker = make_core()
    with core.wakes_deferred():
        core.wake()
        core.wake()
        assert waker.sent == []
    assert waker.sent == [b"\0"]
    core.wake()  # after the block: at once again
    assert len(waker.sent) == 2


def test_a_block_without_wakes_wakes_nobody() -> None:
    core, waker = make_core()
    with core.wakes_deferred():
        pass
    assert waker.sent == []


def test_other_threads_wake_at_once_during_the_block() -> None:
    core, waker = make_core()
    with core.wakes_deferred():
        other = threading.Thread(target=core.wake)
        other.start()
        other.join(timeout=30.0)
        assert not other.is_alive()
        assert waker.sent == [b"\0"]
    assert waker.sent == [b"\0"]  # this thread asked for none


def test_a_nested_block_leaves_the_wake_to_the_outer_one() -> None:
    core, waker = make_core()
    with core.wakes_deferred():
        with core.wakes_deferred():
            core.wake()
        assert waker.sent == []
    assert waker.sent == [b"\0"]


def test_a_block_that_raises_still_wakes() -> None:
    core, waker = make_core()
    with pytest.raises(RuntimeError), core.wakes_deferred():
        core.wake()
        raise RuntimeError("boom")
    assert waker.sent == [b"\0"]
    with core.wakes_deferred():  # and the thread's state was reset
        assert waker.sent == [b"\0"]
