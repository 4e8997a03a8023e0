"""How fast scattered KV blocks copy on this machine, without any transfer around the copies.

The shared-memory plane's one-copy path copies a request's blocks run by run (a KV block half is
one run of 32 KiB at the Llama-3-8B shape) from P's cache into D's, both scattered in caches much
larger than the request. This probe times the plane's copier (``shm.send.copy_runs``: the C
extension, with ordinary and with non-temporal stores; decision 112) and the Python loop it
replaced (``memoryview`` slice assignment) against one contiguous copy of the same bytes
(``numpy.copyto``, the baseline of ``kvwire bench transfer --backend shm``), in two kinds of memory:
memfd-backed mappings (what ``kvwire.transfer.memory`` allocates: shmem, whose huge pages
depend on ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``) and anonymous numpy arrays (huge
pages per ``transparent_hugepage/enabled``). The ratios are the ceilings the plane's copy can reach.

Usage: ``python benchmarks/shm_copy_probe.py [--mib 256] [--run-kib 32] [--pool 1.25] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvwire.transfer.planes.shm.send import copy_runs, describe_copier, run_table

Array = npt.NDArray[np.uint8]


def memfd_array(num_bytes: int) -> Array:
    fd = os.memfd_create("kvwire-probe")
    try:
        os.ftruncate(fd, num_bytes)
        region = mmap.mmap(fd, num_bytes)
    finally:
        os.close(fd)
    array = np.frombuffer(region, np.uint8)
    array[:] = 1  # fault every page in before timing
    return array


def anonymous_array(num_bytes: int) -> Array:
    array = np.empty(num_bytes, np.uint8)
    array[:] = 1
    return array


def scattered_runs(num_bytes: int, run_bytes: int, pool: float, seed: int = 0) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, bytes): the request's runs at random places of caches
    ``pool`` times its size, in source order (the order the plane copies them in)."""
    rng = random.Random(seed)
    count = num_bytes // run_bytes
    slots = int(pool * count)
    src = sorted(rng.sample(range(slots), count))
    dst = rng.sample(range(slots), count)
    return [(s * run_bytes, d * run_bytes, run_bytes) for s, d in zip(src, dst, strict=True)]


def time_runs(src: Array, dst: Array, runs: list[tuple[int, int, int]]) -> float:
    with memoryview(src) as s_view, memoryview(dst) as d_view:
        start = time.perf_counter()
        for s, d, n in runs:
            d_view[d : d + n] = s_view[s : s + n]
        return time.perf_counter() - start


def time_copier(src: Array, dst: Array, runs: list[tuple[int, int, int]], stream: bool) -> float:
    table = run_table(runs)
    start = time.perf_counter()
    copy_runs(src, dst, table, stream=stream)
    return time.perf_counter() - start


def time_copyto(src: Array, dst: Array) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per copy (256: 2048 tokens, Llama-3-8B)")
    parser.add_argument("--run-kib", type=int, default=32, help="bytes per run (a KV block half)")
    parser.add_argument("--pool", type=float, default=1.25,
                        help="cache size in multiples of the request (1.25: the benchmark's caches)")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many")
    args = parser.parse_args()
    num_bytes = args.mib << 20
    runs = scattered_runs(num_bytes, args.run_kib << 10, args.pool)
    print(f"{len(runs)} runs of {args.run_kib} KiB scattered in caches of {args.pool * args.mib:.0f} MiB; "
          f"best of {args.repeats}; load average {os.getloadavg()[0]:.1f}; copier: {describe_copier()}")
    print("GB/s, and in parentheses the share of one contiguous copy of the same bytes")
    print(f"{'memory':<10} {'contiguous':>11} {'python loop':>15} {'copier':>15} {'streamed':>15}")
    kinds: list[tuple[str, Callable[[int], Array]]] = [("memfd", memfd_array), ("anonymous", anonymous_array)]
    for name, make in kinds:
        cache_bytes = int(args.pool * num_bytes) // (args.run_kib << 10) * (args.run_kib << 10)
        src, dst = make(cache_bytes), make(cache_bytes)
        flat_src, flat_dst = make(num_bytes), make(num_bytes)
        contiguous = min(time_copyto(flat_src, flat_dst) for _ in range(args.repeats))
        loop = min(time_runs(src, dst, runs) for _ in range(args.repeats))
        plain = min(time_copier(src, dst, runs, False) for _ in range(args.repeats))
        streamed = min(time_copier(src, dst, runs, True) for _ in range(args.repeats))
        cells = [f"{num_bytes / t / 1e9:6.1f} ({contiguous / t:4.2f})" for t in (loop, plain, streamed)]
        print(f"{name:<10} {num_bytes / contiguous / 1e9:11.1f} " + " ".join(f"{c:>15}" for c in cells))
        del src, dst, flat_src, flat_dst

if __name__ == "__main__":
    main()
