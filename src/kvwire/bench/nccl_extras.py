"""Extra measurements of the NCCL benchmark: layer-wise overlap with a synthetic forward pass, GPU
memory per communicator by channel count, and the one-launch gather/scatter against per-layer ops."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench import nccl_harness as h
from kvwire.bench.nccl_workers import LAYOUT, KvwireSide, barrier, ceiling, summarize
from kvwire.bench.synthetic_forward import SyntheticForward
from kvwire.transfer.memory import SendItem, gather_blocks, scatter_blocks
from kvwire.transfer.planes.common.group_kernels import PagedLayers, triton_available
from kvwire.transfer.planes.nccl.bindings import CommConfig


def overlap(
    conn: Connection, side: KvwireSide, cache: list[torch.Tensor], ids: torch.Tensor, tokens: int, iters: int
) -> dict[str, Any] | None:
    """Rank 0 runs the forward and saves each layer as it completes; rank 1 receives + scatters."""
    paged = PagedLayers(cache, LAYOUT)
    slab = side.slab((len(cache), 2, ids.numel(), *cache[0].shape[2:]))
    if side.rank == 1:
        for _ in range(iters + 1):
            barrier(conn, 1)
            tid, landing = side.recv_handshake(conn, paged, ids, slab)
            landing.wait()
            conn.send(time.perf_counter())
            side.recv_finish(tid, len(cache), landing)
        return None
    fwd = SyntheticForward(tokens, ids.device)
    alone = []
    for _ in range(iters + 1):
        start, end = fwd.run(cache, ids)
        end.synchronize()
        alone.append(start.elapsed_time(end))
    exposed, with_transfer = [], []
    for _ in range(iters + 1):
        barrier(conn, 0)
        tid = side.send_handshake(conn)  # at the start of the prefill, as the connector does

        def save(layer: int, written: torch.cuda.Event, tid: str = tid) -> None:
            side.gather_stream.wait_event(written)
            with torch.cuda.stream(side.gather_stream):
                paged.gather(ids, slab[layer : layer + 1], layer, layer + 1)
                ready = torch.cuda.Event()
                ready.record(side.gather_stream)
            side.plane.send(side.peer, [SendItem(tid, layer, slab[layer], ready)])

        start, end = fwd.run(cache, ids, save)
        end.synchronize()
        compute_done = time.perf_counter()
        exposed.append(conn.recv() - compute_done)
        with_transfer.append(start.elapsed_time(end))
        side.rec.wait_sent(tid, len(cache))
    layer_ms = statistics.median(alone[1:]) / len(cache)
    exposed_ms = statistics.median(exposed[1:]) * 1e3
    return {
        "tokens": tokens,
        "forward_ms": round(statistics.median(alone[1:]), 3),
        "forward_with_transfer_ms": round(statistics.median(with_transfer[1:]), 3),
        "layer_compute_ms": round(layer_ms, 4),
        "exposed_ms": round(exposed_ms, 4),
        "exposed_over_layer": round(exposed_ms / layer_ms, 3),
        "goal_met": exposed_ms <= layer_ms,
    }


def comm_memory(
    conn: Connection, rank: int, max_ctas: list[int | None], num_bytes: int
) -> list[dict[str, Any]]:
    """GPU memory one communicator costs (driver free-memory delta after its first send/recv) and the
    bandwidth of one ``num_bytes`` send, per channel bound."""
    out = []
    small = torch.empty(1 << 20, dtype=torch.uint8, device=torch.cuda.current_device())
    stream = torch.cuda.current_stream()
    for bound in max_ctas:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        comm = h.raw_comm(conn, rank, CommConfig(max_ctas=bound, blocking=True))
        if rank == 0:
            comm.send(small.data_ptr(), small.numel(), 1, stream.cuda_stream)
        else:
            comm.recv(small.data_ptr(), small.numel(), 0, stream.cuda_stream)
        h.wait_stream(stream, comm)
        used_mib = (free_before - torch.cuda.mem_get_info()[0]) / (1 << 20)
        samples = ceiling(conn, rank, comm, num_bytes, 8)[2:]
        comm.abort()
        out.append(
            {"max_ctas": bound, "comm_gpu_mib": round(used_mib, 1), **summarize(samples, num_bytes)}
            if rank == 0
            else {}
        )
    return out


def _scatter_each(cache: list[torch.Tensor], ids: torch.Tensor, slab: torch.Tensor) -> None:
    for index, layer in enumerate(cache):
        scatter_blocks(layer, ids, slab[index], LAYOUT)


def _time_ms(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def gather_scatter(cache: list[torch.Tensor], ids: torch.Tensor, tokens: int) -> dict[str, Any]:
    """One-launch (Triton) vs per-layer torch gather/scatter of every layer; bit-exact check."""
    slab = torch.empty(
        (len(cache), 2, ids.numel(), *cache[0].shape[2:]), dtype=torch.bfloat16, device=ids.device
    )
    ref = torch.stack([gather_blocks(layer, ids, LAYOUT) for layer in cache])
    paged = PagedLayers(cache, LAYOUT)
    paged.gather(ids, slab)
    exact = bool(torch.equal(slab.view(torch.int16), ref.view(torch.int16)))
    moved = 2 * slab.numel() * 2  # read + write
    one = _time_ms(lambda: paged.gather(ids, slab))
    per_layer = _time_ms(
        lambda: [gather_blocks(layer, ids, LAYOUT, out=slab[i]) for i, layer in enumerate(cache)]
    )
    one_s = _time_ms(lambda: paged.scatter(ids, slab))
    per_layer_s = _time_ms(lambda: _scatter_each(cache, ids, slab))

    def gbps(ms: float) -> float:
        return round(moved / (ms * 1e-3) / 1e9, 1)

    return {
        "tokens": tokens,
        "triton": triton_available(),
        "bit_exact": exact,
        "gather_one_launch_ms": round(one, 4),
        "gather_per_layer_ms": round(per_layer, 4),
        "scatter_one_launch_ms": round(one_s, 4),
        "scatter_per_layer_ms": round(per_layer_s, 4),
        "gather_one_launch_gbps": gbps(one),
        "gather_per_layer_gbps": gbps(per_layer),
    }
