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
from kvwire.transfer.planes.common.group_kernels import PagedLayers
from kvwire.transfer.planes.nccl import device_signal
from kvwire.transfer.planes.nccl.bindings import NcclComm
from kvwire.transfer.planes.nccl.device_signal import DeviceSignal
from kvwire.transfer.planes.nccl.framing import message_ranges
from kvwire.transfer.planes.nccl.memory import NcclBuffer

MiB = 1 << 20
WARMUP = 3


DEFAULT_VARIANT = {
    "p": 1,
    "free": 32,
    "chunk": 64,
    "edge": 8,
    "ramp": 0,
    "copy": 1,
    "prio": 0,
    "armed": 0,
    "reg": 0,
    "gmid": 0,
    "smid": 0,
    "lanes": 1,
    "even": 0,
}


def parse_variant(spec: str, chunk_mib: int) -> dict[str, int]:
    variant = dict(DEFAULT_VARIANT, chunk=chunk_mib)
    for part in filter(None, spec.split(",")):
        key, value = part.split("=")
        if key not in variant:
            raise SystemExit(f"unknown variant key {key!r}")
        variant[key] = int(value)
    return variant


def ramp_ranges(
    sizes: list[int], max_bytes: int, edge_bytes: int, factor: int, multiple: int = 1
) -> list[tuple[int, int]]:
    """Messages that grow from ``edge_bytes`` (each at most ``factor`` times the one before) up to
    ``max_bytes``, then balanced, then shrink the same way (each at least one layer): the copy of
    message k+1 (gather) or k-1 (scatter) hides behind message k's wire time, with few boundaries."""

    def ramp(order: list[int], budget: int) -> list[int]:
        lengths: list[int] = []
        goal, used, i = edge_bytes, 0, 0
        while goal < max_bytes and i < len(order):
            got = length = 0
            while got < goal and i + length < len(order):
                got += order[i + length]
                length += 1
            if used + got > budget:
                break
            lengths.append(length)
            used += got
            i += length
            goal = min(max_bytes, factor * got)
        return lengths

    half = sum(sizes) // 2
    head = ramp(sizes, half)
    tail = ramp(sizes[::-1], half)
    start, end = sum(head), len(sizes) - sum(tail)
    out: list[tuple[int, int]] = []
    i = 0
    for length in head:
        out.append((i, i + length))
        i += length
    middle = message_ranges(sizes[start:end], max_bytes, 0)
    if multiple > 1 and len(middle) % multiple:  # a middle of a multiple of ``multiple`` messages
        count = -(-len(middle) // multiple) * multiple
        middle = message_ranges(sizes[start:end], -(-sum(sizes[start:end]) // count), 0)
    out += [(start + a, start + b) for a, b in middle]
    j = end
    for length in reversed(tail):
        out.append((j, j + length))
        j += length
    return [r for r in out if r[1] > r[0]]


def capture_sender(
    paged: PagedLayers,
    ids: torch.Tensor,
    slab: torch.Tensor,
    ranges: list[tuple[int, int]],
    comms: list[NcclComm],
    copy: bool = True,
    mid: PagedLayers | None = None,
) -> torch.cuda.CUDAGraph:
    """One graph: gathers on a side stream, each message's send behind its own gather's event
    (message k on ``comms[k % len(comms)]``, each communicator on its own stream: lanes)."""
    layer_bytes = slab[0].numel() * slab.element_size()
    flat = slab.view(-1).view(torch.uint8)
    gather_stream = torch.cuda.Stream()
    capture = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    # what the plane does: capture on a side stream, thread-local mode, no device synchronization
    # (torch.cuda.graph synchronizes the device first, which waits for posted NCCL receives)
    with torch.cuda.stream(capture):
        graph.capture_begin(capture_error_mode="thread_local")
        gather_stream.wait_stream(capture)
        ready = []
        with torch.cuda.stream(gather_stream):
            for number, (start, stop) in enumerate(ranges):
                if copy:  # else: the framing alone (sends of whatever the slab holds)
                    # gathers from the third message on have slack: mid (fewer SMs) when given
                    copier = mid if mid is not None and number >= 2 else paged
                    copier.gather(ids, slab[start:stop], start, stop)
                event = torch.cuda.Event()
                event.record(gather_stream)
                ready.append(event)
        lanes = [capture] + [torch.cuda.Stream() for _ in comms[1:]]
        for lane in lanes[1:]:
            lane.wait_stream(capture)
        for number, ((start, stop), event) in enumerate(zip(ranges, ready, strict=True)):
            lane, comm = lanes[number % len(comms)], comms[number % len(comms)]
            lane.wait_event(event)
            with comm.group(time.monotonic() + 60):
                comm.send(
                    flat[start * layer_bytes :].data_ptr(),
                    (stop - start) * layer_bytes,
                    1,
                    lane.cuda_stream,
                )
        for lane in lanes[1:]:
            capture.wait_stream(lane)
        capture.wait_stream(gather_stream)
        graph.capture_end()
    return graph


def post_receiver(
    paged: PagedLayers,
    ids: torch.Tensor,
    slab: torch.Tensor,
    ranges: list[tuple[int, int]],
    comms: list[NcclComm],
    recv_streams: list[torch.cuda.Stream],
    scatter_stream: torch.cuda.Stream,
    copy: bool = True,
    mid: PagedLayers | None = None,
) -> torch.cuda.Event:
    """Every message's receive, and its scatter right behind it; the returned event marks the end."""
    layer_bytes = slab[0].numel() * slab.element_size()
    flat = slab.view(-1).view(torch.uint8)
    for number, (start, stop) in enumerate(ranges):
        comm, recv_stream = comms[number % len(comms)], recv_streams[number % len(comms)]
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
        if copy:
            # scatters before the last two have slack: mid (fewer SMs) when given
            copier = mid if mid is not None and number < len(ranges) - 2 else paged
            with torch.cuda.stream(scatter_stream):
                copier.scatter(ids, slab[start:stop], start, stop)
    done = torch.cuda.Event()
    done.record(scatter_stream)
    return done


def graph_path(
    conn: Connection,
    rank: int,
    comms: list[NcclComm],
    paged: PagedLayers,
    ids: torch.Tensor,
    ranges: list[tuple[int, int]],
    iters: int,
    recv_priority: int = 0,
    copy: bool = True,
    armed: int = 0,
    slab: torch.Tensor | None = None,
    mid: PagedLayers | None = None,
) -> list[float]:
    if slab is None:
        slab = torch.empty(paged.shape(ids.numel()), dtype=torch.bfloat16, device=ids.device)
    out = []
    if rank == 0:
        graph = capture_sender(paged, ids, slab, ranges, comms, copy, mid)
        send_stream = torch.cuda.Stream()
        ready = torch.ones(1, dtype=torch.int32, device=ids.device)
        torch.cuda.synchronize()
        for _ in range(iters):
            word = None
            if armed:  # queued before t0 behind a device-side wait; t0 fires the word
                signal = DeviceSignal() if armed == 1 else None  # 1: pinned host word (the plane's)
                word = signal.words[0:1] if signal is not None else torch.zeros_like(ready)  # 2: device
                torch.cuda.synchronize()
                address = word.data_ptr()
                with torch.cuda.stream(send_stream):
                    code = device_signal._wait_value32()(send_stream.cuda_stream, address, 1, 0)
                    assert code == 0, code
                    graph.replay()
            w.barrier(conn, 0)
            t0 = time.perf_counter()
            if word is not None:
                word.copy_(ready, non_blocking=True)
            else:
                graph.replay()
            out.append(conn.recv() - t0)
            torch.cuda.synchronize()
        return out
    recv_streams = [torch.cuda.Stream(priority=recv_priority) for _ in comms]
    scatter_stream = torch.cuda.Stream()
    for _ in range(iters):
        done = post_receiver(paged, ids, slab, ranges, comms, recv_streams, scatter_stream, copy, mid)
        w.barrier(conn, 1)
        done.synchronize()
        conn.send(time.perf_counter())
    return out


def rank_main(
    rank: int,
    conn: Connection,
    tokens_list: list[int],
    iters: int,
    chunk_mib: int,
    variants: list[dict[str, int]],
    queue: Any,
    profile: str | None = None,
) -> None:
    h.set_safe_env()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    shape = w.KVShape(cache_blocks=max(1200, 2 * w.KVShape().blocks(max(tokens_list))))
    cache = w.make_cache(shape, device, seed=rank + 1)
    comm = h.raw_comm(conn, rank)
    extra = [h.raw_comm(conn, rank) for _ in range(max(v["lanes"] for v in variants) - 1)]
    high = torch.cuda.Stream.priority_range()[1]  # (low, high): high is the smaller number
    rows = []
    for number, variant in enumerate(variants):
        paged = PagedLayers(cache, w.LAYOUT, programs_per_sm=variant["p"], free_sms=variant["free"])
        mid = None
        if variant["gmid"] if rank == 0 else variant["smid"]:  # copies with slack on fewer SMs
            mid = PagedLayers(cache, w.LAYOUT, programs_per_sm=variant["p"], free_sms=variant["free"])
            mid.max_programs = variant["gmid"] if rank == 0 else variant["smid"]
        copy = bool(variant["copy"])
        comms = [comm, *extra[: variant["lanes"] - 1]]
        for tokens in tokens_list:
            ids = w.block_ids(shape, tokens, device, seed=1000 * tokens + rank)
            num_bytes = shape.layers * shape.layer_bytes(tokens)
            sizes = [shape.layer_bytes(tokens)] * shape.layers
            chunk, edge = variant["chunk"] * MiB, variant["edge"] * MiB
            if variant["ramp"]:
                ranges = ramp_ranges(sizes, chunk, edge, variant["ramp"], variant["even"] or 1)
            else:
                ranges = message_ranges(sizes, chunk, edge)
            slab = abuf = None
            handles: list[tuple[NcclComm, int]] = []
            buffers: list[NcclBuffer] = []
            if variant["reg"]:  # both ends register: NCCL writes into the receiver's buffer directly
                buffers = [NcclBuffer(num_bytes), NcclBuffer(num_bytes)]
                handles = [(c, c.register(b.ptr, b.num_bytes)) for c in comms for b in buffers]
                abuf = buffers[0].tensor
                slab = buffers[1].tensor.view(torch.bfloat16).view(paged.shape(ids.numel()))
            a = w.ceiling(conn, rank, comm, num_bytes, WARMUP + iters, abuf)[WARMUP:]
            a_plain = a
            if abuf is not None:
                a_plain = w.ceiling(conn, rank, comm, num_bytes, WARMUP + iters)[WARMUP:]
            rp = high if variant["prio"] else 0
            run = (copy, variant["armed"], slab, mid)
            g = graph_path(conn, rank, comms, paged, ids, ranges, WARMUP + iters, rp, *run)[WARMUP:]
            if rank == 1:
                w.poison(cache, ids)
            graph_path(conn, rank, comms, paged, ids, ranges, 1, rp, True, 0, slab, mid)
            ok = w.verify(conn, rank, comm, cache, ids)
            if profile:  # untimed: 5 more iterations in one trace per rank
                with h.profiled(profile, f"g{number}-{tokens}", rank):
                    host = graph_path(conn, rank, comms, paged, ids, ranges, 5, rp, *run)
                h.save_host_samples(profile, f"g{number}-{tokens}", rank, host)
            if rank == 0:
                sa, sg = w.summarize(a, num_bytes), w.summarize(g, num_bytes)
                rows.append(
                    {
                        "variant": ",".join(f"{k}={v}" for k, v in variant.items()),
                        "sizes_mib": [sum(sizes[a:b]) >> 20 for a, b in ranges],
                        "tokens": tokens,
                        "messages": len(ranges),
                        "ceiling": sa,
                        "ceiling_plain": w.summarize(a_plain, num_bytes),
                        "graph": sg,
                        "ratio": round(sg["gbps"] / sa["gbps"], 3),
                        "verified": ok,
                    }
                )
            torch.cuda.synchronize()
            for owner, handle in handles:
                owner.deregister(handle)
            for buffer in buffers:
                buffer.close()
    w.barrier(conn, rank)
    for other in extra:
        other.abort()
    comm.abort()
    queue.put((rank, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[512, 2048, 8192])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--chunk-mib", type=int, default=64, help="largest message (first/last: 8 MiB)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="comma-separated overrides of "
        + ",".join(f"{k}={v}" for k, v in DEFAULT_VARIANT.items())
        + " (p: gather/scatter programs per SM, 0 unbounded; free: SMs they leave free; chunk/edge: MiB;"
        " ramp: message sizes grow by"
        " this factor from the edge, 0 = balanced middle; copy=0: framing only, no gather/scatter; prio=1:"
        " receive stream at high priority; armed=1/2: the replay queued before t0 behind a wait on a pinned"
        " host / device word that t0 fires; lanes=N: message k on communicator k %% N, each on its own"
        " stream; even=N: the middle in a multiple of N messages); repeatable",
    )
    parser.add_argument(
        "--profile", default=None, metavar="DIR", help="trace 5 more iterations per variant and size into DIR"
    )
    args = parser.parse_args()
    variants = [parse_variant(spec, args.chunk_mib) for spec in args.variant or [""]]
    ctx = mp.get_context("spawn")
    left, right = ctx.Pipe()
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, c, args.tokens, args.iters, args.chunk_mib, variants, queue, args.profile),
            daemon=True,
        )
        for r, c in ((0, left), (1, right))
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=500) for _ in procs)
    for proc in procs:
        proc.join(timeout=10)
    print(
        f"graph prototype, {torch.cuda.get_device_name(0)} x2, messages <= {args.chunk_mib} MiB "
        f"(median of {args.iters})"
    )
    print("tokens  (a) ceiling GB/s  (a) unregistered  graph GB/s  graph/a  verified  variant  message MiB")
    for row in results[0]:
        ceiling, graph = row["ceiling"]["gbps"], row["graph"]["gbps"]
        plain = row["ceiling_plain"]["gbps"]
        head = f"{row['tokens']:>6} {ceiling:>17} {plain:>17} {graph:>11} {row['ratio']:>8}"
        head += f" {row['verified']!s:>9}"
        print(f"{head}  {row['variant']}  {row['sizes_mib']}")


if __name__ == "__main__":
    main()
