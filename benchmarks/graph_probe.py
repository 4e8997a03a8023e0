"""Prototype: the sender's whole transfer as one CUDA graph (decision 063, "next step"), 2 GPUs.

    python benchmarks/graph_probe.py [--tokens 512 2048 8192] [--iters 10]   (PYTHONPATH=src)

Same KV shape, block ids, ceiling and verification as ``kvwire bench transfer --backend nccl``, but
(c) is replaced by a prototype of what the plane's launch path could become: rank 0 captures, once
per transfer shape, every message's one-launch Triton gather (on a side stream) and its NCCL send
(each waiting for its own gather) into one CUDA graph; a transfer is then ``graph.replay()``: one
host call instead of ~100-300 us of Python per message. Rank 1 posts every message's receive and
a one-launch scatter behind it before t0 (as the plane's device consumers do). No status messages,
no cancellation: this measures the ceiling of the approach, it is not a plane.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench import nccl_harness as h
from kvwire.bench import nccl_workers as w
from kvwire.transfer.cuda_paged import PagedLayers
from kvwire.transfer.nccl_channel import message_ranges
from kvwire.transfer.nccl_lib import NcclComm

MiB = 1 << 20
WARMUP = 3


def capture_sender(
    paged: PagedLayers, ids: torch.Tensor, slab: torch.Tensor, ranges: list[tuple[int, int]], comm: NcclComm
) -> torch.cuda.CUDAGraph:
    """One graph: gathers on a side stream, each message's send behind its own gather's event."""
    layer_bytes = slab[0].numel() * slab.element_size()
    flat = slab.view(-1).view(torch.uint8)
    gather_stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture = torch.cuda.current_stream()
        gather_stream.wait_stream(capture)
        ready = []
        with torch.cuda.stream(gather_stream):
            for start, stop in ranges:
                paged.gather(ids, slab[start:stop], start, stop)
                event = torch.cuda.Event()
                event.record(gather_stream)
                ready.append(event)
        for (start, stop), event in zip(ranges, ready, strict=True):
            capture.wait_event(event)
            with comm.group(time.monotonic() + 60):
                comm.send(
                    flat[start * layer_bytes :].data_ptr(),
                    (stop - start) * layer_bytes,
                    1,
                    capture.cuda_stream,
                )
        capture.wait_stream(gather_stream)
    return graph


def post_receiver(
    paged: PagedLayers,
    ids: torch.Tensor,
    slab: torch.Tensor,
    ranges: list[tuple[int, int]],
    comm: NcclComm,
    recv_stream: torch.cuda.Stream,
    scatter_stream: torch.cuda.Stream,
) -> torch.cuda.Event:
    """Every message's receive, and its scatter right behind it; the returned event marks the end."""
    layer_bytes = slab[0].numel() * slab.element_size()
    flat = slab.view(-1).view(torch.uint8)
    for start, stop in ranges:
        with comm.group(time.monotonic() + 60):
            comm.recv(
                flat[start * layer_bytes :].data_ptr(),
                (stop - start) * layer_bytes,
                0,
                recv_stream.cuda_stream,
            )
        landed = torch.cuda.Event()
        landed.record(recv_stream)
        scatter_stream.wait_event(landed)
        with torch.cuda.stream(scatter_stream):
            paged.scatter(ids, slab[start:stop], start, stop)
    done = torch.cuda.Event()
    done.record(scatter_stream)
    return done


def graph_path(
    conn: Connection,
    rank: int,
    comm: NcclComm,
    paged: PagedLayers,
    ids: torch.Tensor,
    ranges: list[tuple[int, int]],
    iters: int,
) -> list[float]:
    slab = torch.empty(paged.shape(ids.numel()), dtype=torch.bfloat16, device=ids.device)
    out = []
    if rank == 0:
        graph = capture_sender(paged, ids, slab, ranges, comm)
        torch.cuda.synchronize()
        for _ in range(iters):
            w.barrier(conn, 0)
            t0 = time.perf_counter()
            graph.replay()
            out.append(conn.recv() - t0)
            torch.cuda.synchronize()
        return out
    recv_stream, scatter_stream = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(iters):
        done = post_receiver(paged, ids, slab, ranges, comm, recv_stream, scatter_stream)
        w.barrier(conn, 1)
        done.synchronize()
        conn.send(time.perf_counter())
    return out


def rank_main(
    rank: int, conn: Connection, tokens_list: list[int], iters: int, chunk_mib: int, queue: Any
) -> None:
    h.set_safe_env()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    shape = w.KVShape(cache_blocks=max(1200, 2 * w.KVShape().blocks(max(tokens_list))))
    cache = w.make_cache(shape, device, seed=rank + 1)
    paged = PagedLayers(cache, w.LAYOUT)
    comm = h.raw_comm(conn, rank)
    rows = []
    for tokens in tokens_list:
        ids = w.block_ids(shape, tokens, device, seed=1000 * tokens + rank)
        num_bytes = shape.layers * shape.layer_bytes(tokens)
        ranges = message_ranges([shape.layer_bytes(tokens)] * shape.layers, chunk_mib * MiB, 8 * MiB)
        a = w.ceiling(conn, rank, comm, num_bytes, WARMUP + iters)[WARMUP:]
        g = graph_path(conn, rank, comm, paged, ids, ranges, WARMUP + iters)[WARMUP:]
        if rank == 1:
            w.poison(cache, ids)
        graph_path(conn, rank, comm, paged, ids, ranges, 1)
        ok = w.verify(conn, rank, comm, cache, ids)
        if rank == 0:
            sa, sg = w.summarize(a, num_bytes), w.summarize(g, num_bytes)
            rows.append(
                {
                    "tokens": tokens,
                    "messages": len(ranges),
                    "ceiling": sa,
                    "graph": sg,
                    "ratio": round(sg["gbps"] / sa["gbps"], 3),
                    "verified": ok,
                }
            )
    w.barrier(conn, rank)
    comm.abort()
    queue.put((rank, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[512, 2048, 8192])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--chunk-mib", type=int, default=64, help="largest message (first/last: 8 MiB)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    left, right = ctx.Pipe()
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=rank_main, args=(r, c, args.tokens, args.iters, args.chunk_mib, queue), daemon=True
        )
        for r, c in ((0, left), (1, right))
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for proc in procs:
        proc.join(timeout=10)
    print(
        f"graph prototype, {torch.cuda.get_device_name(0)} x2, messages <= {args.chunk_mib} MiB "
        f"(median of {args.iters})"
    )
    print("tokens  msgs  (a) ceiling GB/s  graph GB/s  graph/a  verified")
    for row in results[0]:
        print(
            f"{row['tokens']:>6} {row['messages']:>5} {row['ceiling']['gbps']:>17} "
            f"{row['graph']['gbps']:>11} {row['ratio']:>8} {row['verified']!s:>9}"
        )


if __name__ == "__main__":
    main()
