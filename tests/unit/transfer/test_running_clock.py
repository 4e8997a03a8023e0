"""RunningClock (decision 123): lease time leaves out the time the process did not run."""

from __future__ import annotations

import itertools
import threading

from kvwire.transfer.core import PAUSE_GAP_S, RunningClock


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_steady_readings_follow_monotonic_time() -> None:
    fake = FakeTime()
    clock = RunningClock(fake)
    start = clock.now()
    for _ in range(100):
        fake.t += 0.02  # the control loop's tick
        clock.now()
    assert abs(clock.now() - start - 2.0) < 1e-9
    assert clock.paused_s == 0.0


def test_a_stop_counts_only_the_pause_gap() -> None:
    fake = FakeTime()
    clock = RunningClock(fake)
    start = clock.now()
    fake.t += 5.0  # SIGSTOP for 5 s: no reading in between
    assert abs(clock.now() - start - PAUSE_GAP_S) < 1e-9
    assert abs(clock.paused_s - (5.0 - PAUSE_GAP_S)) < 1e-9
    fake.t += 0.05
    assert abs(clock.now() - start - PAUSE_GAP_S - 0.05) < 1e-9  # runs on normally afterwards


def test_never_goes_backwards_under_concurrent_readers() -> None:
    clock = RunningClock()
    seen: list[list[float]] = [[] for _ in range(4)]

    def read(out: list[float]) -> None:
        for _ in range(2000):
            out.append(clock.now())

    threads = [threading.Thread(target=read, args=(out,)) for out in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for out in seen:
        assert all(b >= a for a, b in itertools.pairwise(out))  # monotonic per thread
