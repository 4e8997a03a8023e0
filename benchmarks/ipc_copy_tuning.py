"""Launch shapes of the CUDA IPC plane's copy kernel, against a contiguous device copy (one GPU).

The plane's mover (``kvwire.transfer.planes.ipc.copy.copy_groups`` over tile tables from
``runs.tile_runs``, exactly as the plane builds them) copies a Llama-3-8B-shaped request (32 layers,
8 KV heads x 128, bf16, 16-token blocks scattered at random in both caches) paged -> paged in one
process, for each tile size / warps / grid cap; device time by CUDA events, best of ``--repeats``.
Same run: one contiguous ``copy_`` of the same bytes (the ceiling) and the per-layer
``index_select`` + ``index_copy_`` a naive mover would use. The first configuration's result is
checked bit for bit. The defaults of ``CopyTuning`` come from this table.

    python benchmarks/ipc_copy_tuning.py [--tokens 512 2048 8192] [--repeats 20] [--per-layer]

``--per-layer``: instead, one launch per layer (what the plane runs when a producer hands layers over
one at a time, as layer-wise serving does), each timed behind the plane's launch gate (so a window
holds only GPU work), summed over the layers, for each tile size / warps / grid cap.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from kvwire.transfer.memory import KVLayout, block_spans
from kvwire.transfer.planes.common.runs import spans_array, tile_runs
from kvwire.transfer.planes.ipc.copy import CopyTuning, LayerGroup, TileTable, copy_groups, launch, prepare

LAYERS, BLOCK, HEADS, DIM = 32, 16, 8, 128


def _timed(fn: object, repeats: int) -> float:
    assert callable(fn)
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--per-layer", action="store_true", help="one gated launch per layer")
    args = parser.parse_args()
    torch.manual_seed(0)
    anchor = torch.empty(4, dtype=torch.int32, device="cuda")
    print(f"{'tokens':>6} {'MiB':>6} {'tile KiB':>8} {'warps':>5} {'p/SM':>5} {'GB/s':>7} {'/ d2d':>6}")
    for tokens in args.tokens:
        if args.per_layer:
            _per_layer(tokens, args.repeats, anchor)
        else:
            _one_size(tokens, args.repeats, anchor)
    _host_cost(anchor)


def _per_layer(tokens: int, repeats: int, anchor: torch.Tensor) -> None:
    """Sum of one gated launch per layer, against one contiguous copy of every layer's bytes."""
    from kvwire.transfer.planes.ipc.gate import LaunchGate

    src, dst, src_spans, dst_spans, num_bytes = _caches(tokens)
    flat = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    flat2 = torch.empty_like(flat)
    d2d = _timed(lambda: flat2.copy_(flat), repeats)
    print(f"{tokens:>6} {num_bytes / 2**20:>6.0f} {'d2d':>8} {'':>5} {'':>5} {num_bytes / d2d / 1e9:>7.0f}")
    stream = torch.cuda.Stream()
    gate = LaunchGate()
    for tile_kib, warps, per_sm in itertools.product((4, 8, 16, 32), (4, 8, 16), (8, 32)):
        tuning = CopyTuning(tile_bytes=tile_kib * 1024, programs_per_sm=per_sm, num_warps=warps)
        table = TileTable.build(
            tile_runs(spans_array(src_spans), spans_array(dst_spans), tuning.tile_bytes), torch.device("cuda")
        )
        groups = [LayerGroup(table, [(s.data_ptr(), d.data_ptr())]) for s, d in zip(src, dst, strict=True)]
        copy_groups(groups[:1], anchor, tuning)  # compiles
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            windows = []
            with torch.cuda.stream(stream):
                for group in groups:
                    launches = prepare([group], anchor)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with gate.held(stream):
                        start.record(stream)
                        launch(launches, anchor, tuning)
                        end.record(stream)
                    windows.append((start, end))
            stream.synchronize()
            best = min(best, sum(s.elapsed_time(e) for s, e in windows) / 1e3)
        print(
            f"{tokens:>6} {'layer':>6} {tile_kib:>8} {warps:>5} {per_sm:>5} {num_bytes / best / 1e9:>7.0f} "
            f"{d2d / best:>6.2f}"
        )


def _caches(tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple, tuple, int]:
    blocks = -(-tokens // BLOCK)
    total = blocks + max(16, blocks // 4)
    shape = (2, total, BLOCK, HEADS, DIM)
    src = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    src_spans = block_spans(src[0], torch.randperm(total)[:blocks].tolist(), KVLayout.KV_FIRST).spans
    dst_spans = block_spans(dst[0], torch.randperm(total)[:blocks].tolist(), KVLayout.KV_FIRST).spans
    return src, dst, src_spans, dst_spans, sum(n for _, n in src_spans) * LAYERS


def _timed_launch(group: LayerGroup, anchor: torch.Tensor, tuning: CopyTuning, repeats: int) -> float:
    copy_groups([group], anchor, tuning)  # compiles
    best = float("inf")
    for _ in range(repeats):
        launches = prepare([group], anchor)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(launches, anchor, tuning)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _host_cost(anchor: torch.Tensor) -> None:
    """Host time of prepare and of launch on a tiny group, 200 calls each, unsynchronized."""
    src = torch.zeros(1024, dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    table = TileTable.build(tile_runs(spans_array([(0, 4096)]), spans_array([(0, 4096)]), 4096), src.device)
    group = LayerGroup(table, [(src.data_ptr(), dst.data_ptr())] * 32)
    copy_groups([group], anchor)
    torch.cuda.synchronize()
    start = time.perf_counter()
    prepared = [prepare([group], anchor) for _ in range(200)]
    mid = time.perf_counter()
    for launches in prepared:
        launch(launches, anchor)
    end = time.perf_counter()
    torch.cuda.synchronize()
    print(
        f"host time per call (32 layers, one group): prepare {(mid - start) / 200 * 1e6:.1f} us, "
        f"launch {(end - mid) / 200 * 1e6:.1f} us"
    )


def _one_size(tokens: int, repeats: int, anchor: torch.Tensor) -> None:
    blocks = -(-tokens // BLOCK)
    total = blocks + max(16, blocks // 4)
    shape = (2, total, BLOCK, HEADS, DIM)
    src = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    src_ids = torch.randperm(total)[:blocks].tolist()
    dst_ids = torch.randperm(total)[:blocks].tolist()
    src_spans = block_spans(src[0], src_ids, KVLayout.KV_FIRST).spans
    dst_spans = block_spans(dst[0], dst_ids, KVLayout.KV_FIRST).spans
    num_bytes = sum(n for _, n in src_spans) * LAYERS
    flat = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    flat2 = torch.empty_like(flat)
    d2d = _timed(lambda: flat2.copy_(flat), repeats)
    sid = torch.tensor(src_ids, device="cuda")
    did = torch.tensor(dst_ids, device="cuda")

    def naive() -> None:
        for s, d in zip(src, dst, strict=True):
            d.index_copy_(1, did, s.index_select(1, sid))

    naive_s = _timed(naive, repeats)
    print(f"{tokens:>6} {num_bytes / 2**20:>6.0f} {'d2d':>8} {'':>5} {'':>5} {num_bytes / d2d / 1e9:>7.0f}")
    print(
        f"{tokens:>6} {'':>6} {'naive':>8} {'':>5} {'':>5} {num_bytes / naive_s / 1e9:>7.0f} "
        f"{d2d / naive_s:>6.2f}"
    )
    checked = False
    for tile_kib, warps, per_sm in itertools.product((16, 32, 64), (4, 8, 16), (2, 8, 16, 32, 64)):
        tuning = CopyTuning(tile_bytes=tile_kib * 1024, programs_per_sm=per_sm, num_warps=warps)
        tiles = tile_runs(spans_array(src_spans), spans_array(dst_spans), tuning.tile_bytes)
        table = TileTable.build(tiles, torch.device("cuda"))
        group = LayerGroup(table, [(s.data_ptr(), d.data_ptr()) for s, d in zip(src, dst, strict=True)])
        # as the plane times a batch: the bases' upload prepared, then the clock around the launch
        seconds = _timed_launch(group, anchor, tuning, repeats)
        if not checked:
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(s[:, src_ids].view(torch.int16), d[:, dst_ids].view(torch.int16))
            checked = True
        print(
            f"{tokens:>6} {'':>6} {tile_kib:>8} {warps:>5} {per_sm:>5} {num_bytes / seconds / 1e9:>7.0f} "
            f"{d2d / seconds:>6.2f}"
        )


if __name__ == "__main__":
    main()
