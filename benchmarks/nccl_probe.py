"""Raw NCCL patterns on 2 GPUs, under several NCCL settings: what one message boundary costs.

    python benchmarks/nccl_probe.py        (PYTHONPATH=src, two CUDA GPUs)

For each NCCL environment (fresh processes each: NCCL reads its environment once) moves 64 MiB and
256 MiB from GPU 0 to GPU 1 as one send, and 256 MiB as 4 x 64 MiB and 8 x 32 MiB (one NCCL group
each, with the plane's 8-byte status message). Timing as in the benchmark: t0 on rank 0 after a pipe
barrier, t1 on rank 1 when its stream is done, both ``time.perf_counter``; median of 8 after 2.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench import nccl_harness as h
from kvwire.bench.nccl_workers import barrier

MiB = 1 << 20
TOTAL = 256 * MiB
ITERS = 8


ENVS: list[dict[str, str]] = [
    {},
    {"NCCL_P2P_NVL_CHUNKSIZE": str(2 * MiB)},
    {"NCCL_BUFFSIZE": str(16 * MiB)},
    {"NCCL_P2P_NVL_CHUNKSIZE": str(2 * MiB), "NCCL_BUFFSIZE": str(16 * MiB)},
    {"NCCL_MIN_NCHANNELS": "32"},
]
CASES = {  # name: (total bytes, message bytes)
    "one 64 MiB send": (64 * MiB, 64 * MiB),
    "one 256 MiB send": (TOTAL, TOTAL),
    "4 x 64 MiB + status": (TOTAL, 64 * MiB),
    "8 x 32 MiB + status": (TOTAL, 32 * MiB),
}


def _pattern(conn: Connection, rank: int, comm: Any, buf: torch.Tensor, total: int, chunk: int) -> float:
    stream = torch.cuda.current_stream()
    flag = torch.zeros(2, dtype=torch.int32, device=buf.device)
    op = comm.send if rank == 0 else comm.recv
    peer = 1 - rank
    samples = []
    for _ in range(ITERS + 2):
        barrier(conn, rank)
        t0 = time.perf_counter()
        for start in range(0, total, chunk):
            with comm.group(time.monotonic() + 60):
                op(buf.data_ptr() + start, chunk, peer, stream.cuda_stream)
                if chunk < total:
                    op(flag.data_ptr(), 8, peer, stream.cuda_stream)
        h.wait_stream(stream, comm)
        if rank == 1:
            conn.send(time.perf_counter())
        else:
            samples.append(conn.recv() - t0)
    return statistics.median(samples[2:]) * 1e3 if samples else 0.0


def run_rank(rank: int, conn: Connection, env: dict[str, str]) -> dict[str, float]:
    os.environ.update(env)
    h.set_safe_env()
    torch.cuda.set_device(rank)
    comm = h.raw_comm(conn, rank)
    buf = torch.empty(TOTAL, dtype=torch.uint8, device=f"cuda:{rank}")
    out = {name: _pattern(conn, rank, comm, buf, *args) for name, args in CASES.items()}
    comm.abort()
    return out


def _rank0(conn: Connection, env: dict[str, str]) -> dict[str, float]:
    return run_rank(0, conn, env)


def _rank1(conn: Connection, env: dict[str, str]) -> dict[str, float]:
    return run_rank(1, conn, env)


def main() -> int:
    h.set_safe_env()
    ctx = mp.get_context("spawn")
    print(f"{'NCCL settings':44s} " + " ".join(f"{name:>22s}" for name in CASES))
    for env in ENVS:
        left, right = ctx.Pipe()
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=h.run_in_child, args=(fn, r, c, queue, env), daemon=True)
            for fn, r, c in ((_rank0, 0, left), (_rank1, 1, right))
        ]
        for proc in procs:
            proc.start()
        try:
            report = h.child_results(queue, 2, timeout_s=120)["_rank0"]
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
        label = " ".join(f"{k}={v}" for k, v in env.items()) or "defaults"
        cells = [f"{ms:.3f} ms {CASES[name][0] / ms / 1e6:5.0f} GB/s" for name, ms in report.items()]
        print(f"{label:44s} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
