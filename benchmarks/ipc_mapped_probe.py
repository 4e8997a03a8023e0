"""Is memory mapped from another process (CUDA IPC, same GPU) slower to write than local memory?

Two processes on one GPU. The receiver allocates a Llama-3-8B-shaped paged cache (32 layers) and
sends each layer's IPC handle; the sender maps them and times the IPC plane's copy kernel (one gated
launch for all layers, as the plane runs a batch) from its own cache into (a) the mapped cache and
(b) a local cache of the same shape, alternating, best and median of ``--repeats``; (c) one contiguous
copy of the same bytes. Answers whether the plane's copy/d2d gap comes from the mapping.

    python benchmarks/ipc_mapped_probe.py [--tokens 2048 8192] [--repeats 30] [--gap-ms 7]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import torch

LAYERS, BLOCK, HEADS, DIM = 32, 16, 8, 128


def _shape(tokens: int) -> tuple[tuple[int, ...], int]:
    blocks = -(-tokens // BLOCK)
    return (2, blocks + max(16, blocks // 4), BLOCK, HEADS, DIM), blocks


def _receiver(conn: Connection, tokens: int) -> None:
    from kvwire.transfer.planes.ipc.cuda_ipc import allocation_of, export_handle

    torch.cuda.set_device(0)
    shape, _ = _shape(tokens)
    dst = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    out = []
    for t in dst:
        base, _ = allocation_of(t)
        out.append((export_handle(base), t.data_ptr() - base))
    conn.send(out)
    conn.recv()  # the sender is done


def _time(
    fn: object, stream: torch.cuda.Stream, gate: object, repeats: int, gap_s: float = 0.0
) -> list[float]:
    assert callable(fn)
    times = []
    for _ in range(repeats):
        time.sleep(gap_s)  # the GPU idles (as between a plane's transfers)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), gate.held(stream):  # type: ignore[attr-defined]
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def main() -> None:
    from kvwire.transfer.memory import KVLayout, block_spans
    from kvwire.transfer.planes.common.runs import spans_array, tile_runs
    from kvwire.transfer.planes.ipc.copy import LayerGroup, TileTable, copy_groups, launch, prepare
    from kvwire.transfer.planes.ipc.cuda_ipc import open_handle
    from kvwire.transfer.planes.ipc.gate import LaunchGate

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=0.0, help="GPU idle before each timed copy")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    anchor = torch.empty(4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    gate = LaunchGate()
    print(f"{'tokens':>6} {'MiB':>6} {'into':>7} {'best GB/s':>9} {'median':>7} {'best/d2d':>8}")
    for tokens in args.tokens:
        ctx = mp.get_context("spawn")
        left, right = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(right, tokens), daemon=True)
        proc.start()
        shape, blocks = _shape(tokens)
        src = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        local = [torch.zeros_like(s) for s in src]
        mapped = [open_handle(h) + shift for h, shift in left.recv()]
        ids = torch.randperm(shape[1])[:blocks].tolist(), torch.randperm(shape[1])[:blocks].tolist()
        src_spans = block_spans(src[0], ids[0], KVLayout.KV_FIRST).spans
        dst_spans = block_spans(local[0], ids[1], KVLayout.KV_FIRST).spans
        tiles = tile_runs(spans_array(src_spans), spans_array(dst_spans), 32 * 1024)
        table = TileTable.build(tiles, anchor.device)
        num_bytes = table.layer_bytes * LAYERS
        local_bases = [d.data_ptr() for d in local]
        groups = {
            "mapped": LayerGroup(table, [(s.data_ptr(), m) for s, m in zip(src, mapped, strict=True)]),
            "local": LayerGroup(table, [(s.data_ptr(), d) for s, d in zip(src, local_bases, strict=True)]),
        }
        for group in groups.values():
            copy_groups([group], anchor)  # compiles, maps
        torch.cuda.synchronize()
        flat = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        d2d_copy = functools.partial(torch.empty_like(flat).copy_, flat)
        times: dict[str, list[float]] = {name: [] for name in (*groups, "d2d")}
        for _ in range(args.repeats):  # alternate, so clocks and neighbours affect all alike
            for name, group in groups.items():
                launches = prepare([group], anchor)
                times[name] += _time(
                    lambda launches=launches: launch(launches, anchor), stream, gate, 1, args.gap_ms / 1e3
                )
            times["d2d"] += _time(d2d_copy, stream, gate, 1, args.gap_ms / 1e3)
        d2d = min(times["d2d"])
        for name, ts in times.items():
            print(
                f"{tokens:>6} {num_bytes / 2**20:>6.0f} {name:>7} {num_bytes / min(ts) / 1e9:>9.0f} "
                f"{num_bytes / statistics.median(ts) / 1e9:>7.0f} {d2d / min(ts):>8.2f}"
            )
        left.send("done")
        proc.join(timeout=30)


if __name__ == "__main__":
    main()
