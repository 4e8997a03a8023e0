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

import torch

from kvwire.transfer.device_signal import DeviceSignal, prepare, wait_ready


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
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.9)]


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


if __name__ == "__main__":
    main()
