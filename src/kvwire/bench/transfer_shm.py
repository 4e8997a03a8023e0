"""``kvwire bench transfer --backend shm``: the shared-memory plane against memcpy and the TCP plane.

Same workload as the TCP benchmark (:mod:`kvwire.bench.transfer`: Llama-3-8B-shaped paged KV, the
request's blocks scattered in both caches, paged -> paged as byte spans, every destination byte
checked). Measured in one run, interleaved, best of ``--repeats``:

* ``shm``: two agents negotiating the shared-memory plane (the default between processes of one host);
* (a) ``memcpy``: one single-threaded copy of the same number of bytes, contiguous to contiguous
  (numpy ``copyto``: one ``memcpy``) - the ceiling of any one-copy path;
* (b) ``tcp``: two agents forced to the TCP plane (zero-copy iovecs, as today between hosts).

Both agents of a pair live in this process (as in the TCP benchmark); the plane's two copies run on
two threads that release the GIL for each memcpy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import numpy as np
import torch

from kvwire.bench.transfer import MiB, Shape, _Caches, _transfer_once
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import Transport

DEFAULT_TOKENS = (512, 2048, 8192)


@dataclasses.dataclass
class ShmResult:
    tokens: int
    num_bytes: int
    shm_seconds: float
    shm_gbps: float
    memcpy_seconds: float  # (a) one single-threaded memcpy of the same bytes
    memcpy_gbps: float
    tcp_seconds: float  # (b) the TCP plane, same workload
    tcp_gbps: float
    vs_memcpy: float  # shm_gbps / memcpy_gbps (goal >= 0.7 at >= 2048 tokens)
    vs_tcp: float  # shm_gbps / tcp_gbps (goal >= 2 at >= 2048 tokens)
    verified: bool


def _memcpy_once(src: np.ndarray, dst: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def measure(tokens: int, shape: Shape, repeats: int) -> ShmResult:
    caches = _Caches(tokens, shape)
    budget = max(256 * MiB, 4 * caches.spec.num_bytes)
    configs = {
        name: TransferConfig(recv_budget_bytes=budget, spill_budget_bytes=0, transport=Transport(name))
        for name in ("shm", "tcp")
    }
    src = np.frombuffer(torch.randint(0, 255, (caches.num_bytes,), dtype=torch.uint8).numpy(), np.uint8)
    dst = np.empty_like(src)
    times: dict[str, list[float]] = {"shm": [], "tcp": [], "memcpy": []}
    verified = True
    with (
        TransferAgent(configs["shm"]) as shm_tx,
        TransferAgent(configs["shm"]) as shm_rx,
        TransferAgent(configs["tcp"]) as tcp_tx,
        TransferAgent(configs["tcp"]) as tcp_rx,
    ):
        pairs = {"shm": (shm_tx, shm_rx), "tcp": (tcp_tx, tcp_rx)}
        for tx, rx in pairs.values():  # warm-up: links, rings, page faults
            _transfer_once(tx, rx, caches, zero_copy=True)
        _memcpy_once(src, dst)
        for rep in range(repeats + 1):
            last = rep == repeats
            for name, (tx, rx) in pairs.items():
                if last:
                    for d in caches.dst:
                        d.zero_()
                elapsed = _transfer_once(tx, rx, caches, zero_copy=True)
                if last:
                    verified = verified and caches.verify()
                else:
                    times[name].append(elapsed)
            if not last:
                times["memcpy"].append(_memcpy_once(src, dst))
        assert shm_tx.peer_transports() == {shm_rx.endpoint: "shm"}, shm_tx.peer_transports()
    best = {k: min(v) for k, v in times.items()}
    gbps = {k: caches.num_bytes / v / 1e9 for k, v in best.items()}
    return ShmResult(
        tokens=tokens,
        num_bytes=caches.num_bytes,
        shm_seconds=best["shm"],
        shm_gbps=gbps["shm"],
        memcpy_seconds=best["memcpy"],
        memcpy_gbps=gbps["memcpy"],
        tcp_seconds=best["tcp"],
        tcp_gbps=gbps["tcp"],
        vs_memcpy=gbps["shm"] / gbps["memcpy"],
        vs_tcp=gbps["shm"] / gbps["tcp"],
        verified=verified,
    )


def run(args: argparse.Namespace) -> int:
    shape = Shape(num_layers=args.layers)
    results = [measure(t, shape, max(1, args.repeats)) for t in (args.tokens or DEFAULT_TOKENS)]
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "transfer",
                    "backend": "shm",
                    "shape": {**dataclasses.asdict(shape), "dtype": str(shape.dtype)},
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "results": [dataclasses.asdict(r) for r in results],
                }
            )
        )
    else:
        _print_table(results, shape)
    return 0 if all(r.verified for r in results) else 1


def _print_table(results: list[ShmResult], shape: Shape) -> None:
    print(
        f"KV transfer, shared memory vs memcpy vs TCP: {shape.num_layers} layers x [2, tokens, "
        f"{shape.num_kv_heads}, {shape.head_dim}] {str(shape.dtype).removeprefix('torch.')}, paged "
        f"(block {shape.block_size}) -> paged"
    )
    print(
        f"{'tokens':>7} {'MiB':>7} {'shm ms':>8} {'GB/s':>6} {'memcpy ms':>9} {'GB/s':>6} "
        f"{'tcp ms':>8} {'GB/s':>6} {'/memcpy':>7} {'/tcp':>5}  verified"
    )
    for r in results:
        print(
            f"{r.tokens:>7} {r.num_bytes / MiB:>7.1f} {r.shm_seconds * 1e3:>8.2f} {r.shm_gbps:>6.2f} "
            f"{r.memcpy_seconds * 1e3:>9.2f} {r.memcpy_gbps:>6.2f} {r.tcp_seconds * 1e3:>8.2f} "
            f"{r.tcp_gbps:>6.2f} {r.vs_memcpy:>7.2f} {r.vs_tcp:>5.2f}  {r.verified}"
        )
    print(
        "goals at >= 2048 tokens: /memcpy >= 0.7 (one single-threaded memcpy of the same bytes), /tcp >= 2."
    )
