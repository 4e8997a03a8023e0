"""Host (CPU) time of the per-message operations of the NCCL plane's launch path, one GPU.

    python benchmarks/host_costs.py        (PYTHONPATH=src, one CUDA GPU)

Median microseconds per call over 200 calls (after 20 warm-up calls) of each piece the plane and
its callers run per NCCL message: CUDA events and stream switches, the gate arm copy, the status
copy to pinned memory, the one-launch Triton gather/scatter (from the main thread, and from a second
thread while a third waits in ``Event.synchronize`` like the plane's completer), and a torch
per-layer gather for comparison. NCCL launches: ``benchmarks/launch_probe.py``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch

from kvwire.transfer.memory import KVLayout, gather_blocks
from kvwire.transfer.planes.common.group_kernels import PagedLayers

REPS = 200


def per_call_us(fn: Callable[[], object], reps: int = REPS) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cache = [torch.zeros((2, 1200, 16, 8, 128), dtype=torch.bfloat16, device=dev) for _ in range(32)]
    paged = PagedLayers(cache, KVLayout.KV_FIRST)
    ids = torch.randperm(1200, device=dev)[:128]
    slab = torch.empty(paged.shape(128), dtype=torch.bfloat16, device=dev)
    gate = torch.zeros(4, dtype=torch.int32, device=dev)
    armed = torch.tensor([0, 0, 1, 0], dtype=torch.int32, device=dev)
    ring = torch.zeros((1024, 4), dtype=torch.int32, device=dev)
    host = torch.zeros((1024, 4), dtype=torch.int32, pin_memory=True)
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record()
    flat = slab.view(-1).view(torch.uint8)
    dests = [flat[i * (1 << 20) : (i + 1) * (1 << 20)] for i in range(8)]

    def event_record() -> None:
        torch.cuda.Event().record(side)

    def stream_ctx() -> None:
        with torch.cuda.stream(side):
            pass

    def arm() -> None:
        with torch.cuda.stream(side):
            ring[5].copy_(armed, non_blocking=True)
        other.wait_stream(side)

    def status_d2h() -> None:
        host[5].copy_(ring[5], non_blocking=True)

    def record_streams() -> None:
        for d in dests:
            d.record_stream(side)

    cases: dict[str, Callable[[], object]] = {
        "Event() + record": event_record,
        "stream context enter/exit": stream_ctx,
        "stream.wait_event": lambda: side.wait_event(ev),
        "gate arm (copy + wait_stream)": arm,
        "status copy to pinned host": status_d2h,
        "record_stream x 8": record_streams,
        "Triton gather, 8 layers x 128 blocks": lambda: paged.gather(ids, slab[8:16], 8, 16),
        "Triton gated scatter, 8 layers": lambda: paged.scatter(ids, slab[8:16], 8, 16, gate=gate),
        "torch gather_blocks, 1 layer": lambda: gather_blocks(cache[0], ids, KVLayout.KV_FIRST),
    }
    for name, fn in cases.items():
        print(f"{name:44s} {per_call_us(fn):8.1f} us", flush=True)

    # the same Triton launch from a worker thread while another thread waits in Event.synchronize
    stop = threading.Event()

    def completer() -> None:
        while not stop.is_set():
            e = torch.cuda.Event()
            with torch.cuda.stream(other):
                torch.cuda._sleep(2_000_000)  # ~1 ms of GPU spin
                e.record(other)
            e.synchronize()

    waiter = threading.Thread(target=completer, daemon=True)
    waiter.start()
    out: list[float] = []
    worker = threading.Thread(
        target=lambda: out.append(per_call_us(lambda: paged.scatter(ids, slab[8:16], 8, 16, gate=gate)))
    )
    worker.start()
    worker.join(timeout=60)
    stop.set()
    waiter.join(timeout=10)
    print(f"{'Triton gated scatter, worker thread + waiter':44s} {out[0] if out else float('nan'):8.1f} us")


if __name__ == "__main__":
    main()
