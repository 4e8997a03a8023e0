"""Host time of one NCCL message launch on a connected communicator, two GPUs, two processes.

    python benchmarks/launch_probe.py        (PYTHONPATH=src, 2 CUDA GPUs)

What the NCCL plane does per message on its launch thread: ``ncclGroupStart``, ``ncclSend`` of the
data (1 MiB) and of the 8-byte status, ``ncclGroupEnd`` (blocking communicator), then an event
record. Median microseconds over 256 launches (synchronized every 16), for the enqueue calls made
through ``ctypes.CDLL`` (GIL released around each call) and ``ctypes.PyDLL`` (GIL held), each with
the process otherwise idle, with a second Python thread busy in pure Python (as an engine or the
agent would be), and the same with the interpreter's switch interval lowered from 5 ms to 100 us.
Rank 1 posts the matching receives the same way.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch

from kvwire.bench import nccl_harness as h
from kvwire.bench.nccl_workers import barrier

REPS = 256
BATCH = 16


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def launches(comm: h.NcclComm, rank: int, data: torch.Tensor, status: torch.Tensor) -> list[float]:
    stream = torch.cuda.current_stream()
    out = []
    for rep in range(REPS):
        t0 = time.perf_counter()
        with comm.group(time.monotonic() + 30):
            if rank == 0:
                comm.send(data.data_ptr(), data.numel(), 1, stream.cuda_stream)
                comm.send(status.data_ptr(), 8, 1, stream.cuda_stream)
            else:
                comm.recv(data.data_ptr(), data.numel(), 0, stream.cuda_stream)
                comm.recv(status.data_ptr(), 8, 0, stream.cuda_stream)
        torch.cuda.Event().record(stream)
        out.append(time.perf_counter() - t0)
        if rep % BATCH == BATCH - 1:
            stream.synchronize()
    return out


def rank_main(rank: int, conn: Connection) -> None:
    h.set_safe_env()
    torch.cuda.set_device(rank)
    comm = h.raw_comm(conn, rank)
    data = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    status = torch.zeros(2, dtype=torch.int32, device="cuda")
    launches(comm, rank, data, status)  # connect + warm up
    for contended, interval in ((False, None), (True, None), (True, 1e-4)):
        for hold in (False, True):
            comm.hold_gil = hold
            default_interval = sys.getswitchinterval()
            if interval is not None:
                sys.setswitchinterval(interval)
            stop = threading.Event()
            worker = threading.Thread(target=busy, args=(stop,), daemon=True)
            if contended:
                worker.start()
            barrier(conn, rank)
            samples = launches(comm, rank, data, status)
            stop.set()
            if contended:
                worker.join(timeout=5)
            torch.cuda.synchronize()
            sys.setswitchinterval(default_interval)
            med = statistics.median(samples) * 1e6
            p90 = sorted(samples)[int(0.9 * len(samples))] * 1e6
            gil = "PyDLL (GIL held)" if hold else "CDLL (GIL released)"
            other = "busy Python thread" if contended else "idle process"
            if interval is not None:
                other += f", switch interval {interval * 1e6:.0f} us"
            print(
                f"rank {rank} {'send' if rank == 0 else 'recv'}: {gil:22s} {other:20s} "
                f"median {med:7.1f} us  p90 {p90:7.1f} us",
                flush=True,
            )
    barrier(conn, rank)
    comm.abort()


def main() -> None:
    ctx = mp.get_context("spawn")
    left, right = ctx.Pipe()
    procs = [ctx.Process(target=rank_main, args=(r, c)) for r, c in ((0, left), (1, right))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
            raise SystemExit("launch probe timed out")


if __name__ == "__main__":
    main()
