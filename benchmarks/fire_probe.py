"""Host cost of :meth:`DeviceSignal.fire` (the P instance's step at the end of its forward), 1 GPU.

    python benchmarks/fire_probe.py [--iters 200]   (PYTHONPATH=src)

A transfer is armed (a stream waits on the signal, an event behind the wait), then ``fire()`` is
timed on the host. With ``waiter``, another thread is blocked in ``event.synchronize()`` on that
event meanwhile, as the NCCL plane's completer is while a transfer is armed; ``blocking`` makes the
event a blocking-sync one (the waiting thread sleeps instead of spinning in the driver); ``idle``
sleeps 1 ms before the fire (the caller comes out of a wait, as the benchmark's sender does from its
pipe). Prints the median and 90th percentile in microseconds per case.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch

from kvwire.transfer.planes.nccl import device_signal
from kvwire.transfer.planes.nccl.device_signal import DeviceSignal, prepare, wait_ready


def _median_p90(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.9)]


def measure(iters: int, waiter: bool, blocking: bool, idle: bool) -> tuple[float, float]:
    stream = torch.cuda.Stream()
    samples = []
    for _ in range(iters):
        signal = DeviceSignal()
        wait_ready(stream, signal)
        event = torch.cuda.Event(blocking=blocking)
        event.record(stream)
        thread = None
        if waiter:
            started = threading.Event()

            def wait(event: torch.cuda.Event = event, started: threading.Event = started) -> None:
                started.set()
                event.synchronize()

            thread = threading.Thread(target=wait, daemon=True)
            thread.start()
            started.wait(5.0)
        if idle:  # the caller was asleep (the benchmark's sender waits on a pipe before t0); with a
            time.sleep(0.001)  # waiter: it is inside the driver's wait by then (nothing relies on it)
        t0 = time.perf_counter()
        signal.fire()
        samples.append((time.perf_counter() - t0) * 1e6)
        event.synchronize()
        if thread is not None:
            thread.join(5.0)
    return _median_p90(samples)


def after_idle(iters: int, step: Callable[[], object]) -> tuple[float, float]:
    """Host time of ``step`` right after a 1 ms sleep (the GPU idle meanwhile), median and p90."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        time.sleep(0.001)
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return _median_p90(samples)


def idle_steps() -> dict[str, Callable[[], object]]:
    """What a sender could do at t0, each alone: where the after-idle cost of fire() comes from."""
    signal = DeviceSignal()
    raw = torch.cuda.current_stream().cuda_stream
    write = device_signal._write_value32()
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    pinned = torch.ones(1, dtype=torch.int32).pin_memory()

    def memop() -> None:
        write(raw, signal.address, 0, 0)

    return {
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "DeviceSignal.fire()": signal.fire,
        "cuStreamWriteValue32 only": memop,
        "kernel launch (fill_ of a device word)": lambda: word.fill_(1),
        "4-byte host-to-device copy": lambda: word.copy_(pinned, non_blocking=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    prepare(device)
    print(f"fire() host time on {torch.cuda.get_device_name(device)}, {args.iters} iterations (us)")
    print(f"{'case':<44} {'median':>8} {'p90':>8}")
    cases = ((False, False, False), (False, False, True), (True, False, True), (True, True, True))
    for waiter, blocking, idle in cases:
        median, p90 = measure(args.iters, waiter, blocking, idle)
        case = f"waiter={waiter}, blocking={blocking}, idle={idle}"
        print(f"{case:<44} {median:>8.1f} {p90:>8.1f}")
    print("one step after 1 ms idle (us)")
    for name, step in idle_steps().items():
        step()  # loaded and warm
        median, p90 = after_idle(args.iters, step)
        print(f"{name:<44} {median:>8.1f} {p90:>8.1f}")


if __name__ == "__main__":
    main()
