"""The benchmarks' serving-path harness (what ``bench transfer --backend nccl`` times as (c)) runs
through two real processes on CPU with the TCP plane: same connectors, same agents, bit-exact."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench.serving_path import KVGeometry, ServingSide, run_transfers
from kvwire.transfer import TransferConfig

GEOMETRY = KVGeometry(layers=3, heads=2, head_dim=32, block_size=16, num_blocks=40, dtype=torch.float32)


def _side(rank: int, conn: Connection, queue: Any) -> None:
    try:
        side = ServingSide(rank, GEOMETRY, TransferConfig(default_deadline_s=30.0))
        try:
            queue.put((rank, run_transfers(conn, side, tokens=200, iters=2, warmup=1), None))
        finally:
            side.close()
    except BaseException as exc:  # reported to the test, which fails with it
        queue.put((rank, None, repr(exc)))


def test_serving_path_moves_kv_between_two_processes_bit_exact() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=_side, args=(rank, conn, queue)) for rank, conn in ((0, a), (1, b))]
    for proc in procs:
        proc.start()
    try:
        results = {}
        for _ in procs:
            rank, value, error = queue.get(timeout=120)
            assert error is None, f"rank {rank}: {error}"
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    p = results[0]
    assert p["verified"] is True
    assert len(p["samples_s"]) == 2 and all(s > 0 for s in p["samples_s"])
    assert p["bytes"] == GEOMETRY.transfer_bytes(200) == 3 * 13 * 2 * 16 * 2 * 32 * 4
