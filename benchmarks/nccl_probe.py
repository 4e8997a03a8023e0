"""Where does a coalesced chunk's time go? Raw NCCL patterns against the NCCL plane, on 2 GPUs.

    python benchmarks/nccl_probe.py        (PYTHONPATH=src, two CUDA GPUs)

Moves 256 MiB from GPU 0 to GPU 1 in several ways (one send; 8 x 32 MiB groups with and without the
8-byte status message and per-chunk events; 32 x 8 MiB; all in one group) and then through the plane
(32 layers of 8 MiB back to back, chunk plans known, no gather/scatter), printing per-chunk launch and
completion times of the plane. Timing as in the benchmark: t0 on rank 0 after a pipe barrier, t1 on
rank 1 when its stream is done, both ``time.perf_counter``.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench import nccl_harness as h
from kvwire.bench.nccl_workers import barrier
from kvwire.transfer.nccl import NcclPlaneConfig

MiB = 1 << 20
TOTAL = 256 * MiB
ITERS = 8


def _pattern(
    conn: Connection,
    rank: int,
    comm: Any,
    buf: torch.Tensor,
    chunk: int,
    status: bool,
    events: bool,
    one_group: bool,
) -> float:
    stream = torch.cuda.current_stream()
    flag = torch.zeros(2, dtype=torch.int32, device=buf.device)
    flag_host = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    op = comm.send if rank == 0 else comm.recv
    peer = 1 - rank
    samples = []
    for _ in range(ITERS):
        barrier(conn, rank)
        t0 = time.perf_counter()
        chunks = range(0, TOTAL, chunk)
        groups = [list(chunks)] if one_group else [[c] for c in chunks]
        for group in groups:
            with comm.group(time.monotonic() + 60):
                for start in group:
                    op(buf.data_ptr() + start, chunk, peer, stream.cuda_stream)
                    if status:
                        op(flag.data_ptr(), 8, peer, stream.cuda_stream)
            if events:
                if rank == 1 and status:
                    flag_host.copy_(flag, non_blocking=True)
                torch.cuda.Event().record(stream)
        h.wait_stream(stream, comm)
        if rank == 1:
            conn.send(time.perf_counter())
        else:
            samples.append(conn.recv() - t0)
    return statistics.median(samples[2:]) * 1e3 if samples else 0.0


def _plane(conn: Connection, rank: int, chunk_mib: int) -> tuple[float, list[Any]]:
    plane, rec = h.start_plane(rank, f"probe{chunk_mib}-{rank}", NcclPlaneConfig(chunk_bytes=chunk_mib * MiB))
    peer = h.peer_ref(f"probe{chunk_mib}-{1 - rank}")
    slab = torch.empty(TOTAL, dtype=torch.uint8, device=f"cuda:{rank}")
    sizes = [8 * MiB] * 32
    samples, trace, t0 = [], [], 0.0
    for it in range(ITERS):
        tid = f"p{it}"
        if rank == 1:
            conn.send(h.post_layers(plane, peer, tid, sizes, slab))
            barrier(conn, 1)
            rec.wait_received(tid, 32)
            conn.send(time.perf_counter())
        else:
            plane.on_peer_info(peer, conn.recv())
            barrier(conn, 0)
            t0 = time.perf_counter()
            h.send_layers(plane, peer, tid, [slab[i * 8 * MiB : (i + 1) * 8 * MiB] for i in range(32)])
            samples.append(conn.recv() - t0)
            rec.wait_sent(tid, 32)
    trace = plane.chunk_trace()
    if rank == 0:
        conn.send(t0)
    else:
        t0 = conn.recv()
    plane.close()
    last = [row for row in trace][-TOTAL // (chunk_mib * MiB) :]
    rows = [
        (kind, seq, round((a - t0) * 1e6), round((b - t0) * 1e6), round((c - t0) * 1e6))
        for kind, _, seq, _, a, b, c in last
    ]
    return (statistics.median(samples[2:]) * 1e3 if samples else 0.0), rows


def run_rank(rank: int, conn: Connection) -> dict[str, Any]:
    h.set_safe_env()
    torch.cuda.set_device(rank)
    comm = h.raw_comm(conn, rank)
    buf = torch.empty(TOTAL, dtype=torch.uint8, device=f"cuda:{rank}")
    out: dict[str, Any] = {}
    cases = {
        "one 256 MiB send": (TOTAL, False, False, False),
        "8 x 32 MiB, a group each": (32 * MiB, False, False, False),
        "  + 8-byte status in each group": (32 * MiB, True, False, False),
        "  + per-chunk event (+ status D2H)": (32 * MiB, True, True, False),
        "32 x 8 MiB, status + events": (8 * MiB, True, True, False),
        "8 x 32 MiB in one group (+status)": (32 * MiB, True, False, True),
    }
    for name, args in cases.items():
        out[name] = _pattern(conn, rank, comm, buf, *args)
    for chunk_mib in (32, 64):
        out[f"plane, chunk {chunk_mib} MiB"], out[f"trace{chunk_mib}"] = _plane(conn, rank, chunk_mib)
    comm.abort()
    return out


def main() -> int:
    h.set_safe_env()
    ctx = mp.get_context("spawn")
    left, right = ctx.Pipe()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=h.run_in_child, args=(fn, r, c, queue, None), daemon=True)
        for fn, r, c in ((_rank0, 0, left), (_rank1, 1, right))
    ]
    for proc in procs:
        proc.start()
    results = h.child_results(queue, 2, timeout_s=300)
    for proc in procs:
        proc.join(timeout=10)
    report, receiver = results["_rank0"], results["_rank1"]
    for name, value in report.items():
        if isinstance(value, float):
            print(f"{name:40s} {value:8.3f} ms  {TOTAL / value / 1e6:7.1f} GB/s")
    for key in ("trace32", "trace64"):
        print(key, "(kind, seq, launch start us, launched us, completion seen us) after t0:")
        for row in report[key] + receiver[key]:
            print("  ", row)
    return 0


def _rank0(conn: Connection, _: Any) -> dict[str, Any]:
    return run_rank(0, conn)


def _rank1(conn: Connection, _: Any) -> dict[str, Any]:
    return run_rank(1, conn)


if __name__ == "__main__":
    sys.exit(main())
