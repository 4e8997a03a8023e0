"""``kvwire bench transfer --backend shm``: the shared-memory plane against memcpy and the TCP plane.

Same workload as the TCP benchmark (:mod:`kvwire.bench.transfer`: Llama-3-8B-shaped paged KV, the
request's blocks scattered in both caches, paged -> paged as byte spans, every destination byte
checked). Measured in one run, interleaved, best of ``--repeats``:

* ``shm``: two agents negotiating the shared-memory plane (the default between processes of one
  host), D's cache allocated in shared memory exactly as the built-in engine allocates its CPU KV
  cache, so the plane takes the path serving takes: one copy, P writes into D's blocks;
* ``ring``: the same agents, D's cache in ordinary memory (as vLLM's CPU caches are): the plane's
  staging ring, two copies;
* (a) ``memcpy``: one single-threaded copy of the same number of bytes, contiguous to contiguous
  (numpy ``copyto``: one ``memcpy``) - the ceiling of any one-copy path;
* (b) ``tcp``: two agents forced to the TCP plane (zero-copy iovecs, as today between hosts).

P (this process) and D (a spawned child process, as prefill and decode are) each hold one agent per
plane; the clock runs from ``start_send`` until every layer is acknowledged by D. D checks every
destination block of the last run of each plane.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import platform
import time
import uuid
from multiprocessing.connection import Connection

import numpy as np
import torch

from kvwire.bench.transfer import MiB, Shape, _Caches
from kvwire.bench.waiting import RECEIVED, SENT, wait_transfer
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import Backend, Transport
from kvwire.transfer.memory import ByteSpans, KVLayout, block_spans
from kvwire.transfer.planes.base import PlaneSet
from kvwire.transfer.planes.shm import send as shm_send
from kvwire.transfer.planes.shm.plane import ShmPlane

DEFAULT_TOKENS = (512, 2048, 8192)


@dataclasses.dataclass
class ShmResult:
    tokens: int
    num_bytes: int
    shm_seconds: float  # one-copy path: D's cache in shared memory (as the engine allocates it)
    shm_gbps: float
    ring_seconds: float  # the staging ring: D's cache in ordinary memory
    ring_gbps: float
    memcpy_seconds: float  # (a) one single-threaded memcpy of the same bytes
    memcpy_gbps: float
    tcp_seconds: float  # (b) the TCP plane, same workload
    tcp_gbps: float
    vs_memcpy: float  # shm_gbps / memcpy_gbps (goal >= 0.7 at >= 2048 tokens)
    vs_tcp: float  # shm_gbps / tcp_gbps (goal >= 2 at >= 2048 tokens)
    verified: bool  # every destination block of the last run of each variant equals its source
    one_copy: bool  # every shm layer took the one-copy path and every ring layer the ring


def _memcpy_once(src: np.ndarray, dst: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class ShmOptions:
    """The plane's knobs under test (None: the config's default)."""

    ring_mib: int | None = None
    copy_threads: int | None = None


def _configs(caches: _Caches, options: ShmOptions) -> dict[str, TransferConfig]:
    budget = max(256 * MiB, 4 * caches.spec.num_bytes)
    extra: dict[str, int] = {}
    if options.ring_mib is not None:
        extra["shm_ring_bytes"] = options.ring_mib * MiB
    if options.copy_threads is not None:
        extra["shm_copy_threads"] = options.copy_threads
    return {
        name: TransferConfig(
            recv_budget_bytes=budget, spill_budget_bytes=0, transport=Transport(name), **extra  # type: ignore[arg-type]
        )
        for name in ("shm", "tcp")
    }


def _shm_plane(agent: TransferAgent) -> ShmPlane:
    planes = agent._planes  # the benchmark checks which path the plane took
    assert isinstance(planes, PlaneSet)
    plane = planes.members[Backend.SHM]
    assert isinstance(plane, ShmPlane)
    return plane


def _verify(caches: _Caches, dst: list[torch.Tensor]) -> bool:
    for src, got in zip(caches.src, dst, strict=True):
        want = src.index_select(1, caches.src_ids_t).view(torch.int16)
        if not torch.equal(got.index_select(1, caches.dst_ids_t).view(torch.int16), want):
            return False
    return True


def _spans(dst: list[torch.Tensor], block_ids: list[int], index: int) -> ByteSpans:
    return block_spans(dst[index], block_ids, KVLayout.KV_FIRST)


def _receiver_process(conn: Connection, tokens: int, shape: Shape, options: ShmOptions) -> None:
    """D in its own process: one receiving agent per plane, the destination caches, verification."""
    caches = _Caches(tokens, shape, shared=True)  # as the engine allocates its CPU KV cache
    dsts = {"shm": caches.dst, "ring": [torch.zeros_like(d) for d in caches.dst], "tcp": caches.dst}
    configs = _configs(caches, options)
    with TransferAgent(configs["shm"]) as shm_rx, TransferAgent(configs["tcp"]) as tcp_rx:
        agents = {"shm": shm_rx, "ring": shm_rx, "tcp": tcp_rx}
        conn.send({name: a.endpoint for name, a in agents.items()})
        while (cmd := conn.recv()) != "stop":
            name, arg, *sender = cmd
            dst = dsts[name]
            if arg == "zero":
                for d in dst:
                    d.zero_()
                conn.send(True)
            elif arg == "verify":
                conn.send(_verify(caches, dst))
            else:
                agent = agents[name]
                agent.expect(  # as serving does (push): D knows P's endpoint from the request
                    arg,
                    num_layers=len(dst),
                    scatter_into=functools.partial(_spans, dst, caches.dst_ids),
                    deadline_s=120.0,
                    sender=sender[0],
                )
                conn.send("expecting")
                wait_transfer(agent, arg, RECEIVED)
                conn.send("received")


def _send_remote(agent: TransferAgent, conn: Connection, name: str, endpoint: str, caches: _Caches) -> float:
    """One request's KV to D's process; the clock stops when every layer is acknowledged."""
    tid = uuid.uuid4().hex
    conn.send((name, tid, agent.endpoint))
    assert conn.recv() == "expecting"
    start = time.perf_counter()
    agent.start_send(tid, endpoint, [caches.spec] * len(caches.src), deadline_s=120.0)
    for i, src in enumerate(caches.src):
        agent.send_layer_spans(tid, i, block_spans(src, caches.src_ids, KVLayout.KV_FIRST))
    wait_transfer(agent, tid, SENT)
    elapsed = time.perf_counter() - start
    assert conn.recv() == "received"
    return elapsed


def measure(tokens: int, shape: Shape, repeats: int, options: ShmOptions | None = None) -> ShmResult:
    """P (this process) sends to D (a child process), over each path, interleaved with memcpy."""
    options = options or ShmOptions()
    caches = _Caches(tokens, shape, shared=True)  # P's cache too: what the engine allocates
    configs = _configs(caches, options)
    src = np.frombuffer(torch.randint(0, 255, (caches.num_bytes,), dtype=torch.uint8).numpy(), np.uint8)
    dst = np.empty_like(src)
    times: dict[str, list[float]] = {"shm": [], "ring": [], "tcp": [], "memcpy": []}
    verified = True
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver_process, args=(child_conn, tokens, shape, options), daemon=True)
    child.start()
    try:
        with TransferAgent(configs["shm"]) as shm_tx, TransferAgent(configs["tcp"]) as tcp_tx:
            senders = {"shm": shm_tx, "ring": shm_tx, "tcp": tcp_tx}
            if not conn.poll(120.0):
                raise TimeoutError("the receiving process did not start within 120 s")
            endpoints = conn.recv()
            for name, agent in senders.items():  # warm-up: links, rings, mappings, page faults
                _send_remote(agent, conn, name, endpoints[name], caches)
            _memcpy_once(src, dst)
            paths: dict[str, collections.Counter[str]] = {}
            for rep in range(repeats + 1):
                last = rep == repeats
                for name, agent in senders.items():
                    if last:
                        conn.send((name, "zero"))
                        conn.recv()
                    before = collections.Counter(_shm_plane(shm_tx).layers_sent)
                    elapsed = _send_remote(agent, conn, name, endpoints[name], caches)
                    paths[name] = collections.Counter(_shm_plane(shm_tx).layers_sent) - before
                    if last:
                        conn.send((name, "verify"))
                        verified = verified and bool(conn.recv())
                    else:
                        times[name].append(elapsed)
                if not last:
                    times["memcpy"].append(_memcpy_once(src, dst))
            assert shm_tx.peer_transports() == {endpoints["shm"]: "shm"}, shm_tx.peer_transports()
            assert tcp_tx.peer_transports() == {endpoints["tcp"]: "tcp"}, tcp_tx.peer_transports()
        conn.send("stop")
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    layers = len(caches.src)
    one_copy = paths["shm"] == {"one_copy": layers} and paths["ring"] == {"ring": layers}
    best = {k: min(v) for k, v in times.items()}
    gbps = {k: caches.num_bytes / v / 1e9 for k, v in best.items()}
    return ShmResult(
        tokens=tokens,
        num_bytes=caches.num_bytes,
        shm_seconds=best["shm"],
        shm_gbps=gbps["shm"],
        ring_seconds=best["ring"],
        ring_gbps=gbps["ring"],
        memcpy_seconds=best["memcpy"],
        memcpy_gbps=gbps["memcpy"],
        tcp_seconds=best["tcp"],
        tcp_gbps=gbps["tcp"],
        vs_memcpy=gbps["shm"] / gbps["memcpy"],
        vs_tcp=gbps["shm"] / gbps["tcp"],
        verified=verified,
        one_copy=one_copy,
    )


def run(args: argparse.Namespace) -> int:
    shape = Shape(num_layers=args.layers)
    options = ShmOptions(getattr(args, "shm_ring_mib", None), getattr(args, "shm_copy_threads", None))
    results = [measure(t, shape, max(1, args.repeats), options) for t in (args.tokens or DEFAULT_TOKENS)]
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "transfer",
                    "backend": "shm",
                    "shape": {**dataclasses.asdict(shape), "dtype": str(shape.dtype)},
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "run_copier": shm_send.describe_copier(),
                    "results": [dataclasses.asdict(r) for r in results],
                }
            )
        )
    else:
        _print_table(results, shape)
    return 0 if all(r.verified and r.one_copy for r in results) else 1


def _print_table(results: list[ShmResult], shape: Shape) -> None:
    print(
        f"KV transfer, shared memory (one copy into D's shared cache; ring: D's cache in ordinary "
        f"memory) vs memcpy vs TCP: {shape.num_layers} layers x [2, tokens, "
        f"{shape.num_kv_heads}, {shape.head_dim}] {str(shape.dtype).removeprefix('torch.')}, paged "
        f"(block {shape.block_size}) -> paged; run copier: {shm_send.describe_copier()}"
    )
    print(
        f"{'tokens':>7} {'MiB':>7} {'shm ms':>8} {'GB/s':>6} {'ring ms':>8} {'GB/s':>6} "
        f"{'memcpy ms':>9} {'GB/s':>6} {'tcp ms':>8} {'GB/s':>6} {'/memcpy':>7} {'/tcp':>5}  verified"
    )
    for r in results:
        print(
            f"{r.tokens:>7} {r.num_bytes / MiB:>7.1f} {r.shm_seconds * 1e3:>8.2f} {r.shm_gbps:>6.2f} "
            f"{r.ring_seconds * 1e3:>8.2f} {r.ring_gbps:>6.2f} "
            f"{r.memcpy_seconds * 1e3:>9.2f} {r.memcpy_gbps:>6.2f} {r.tcp_seconds * 1e3:>8.2f} "
            f"{r.tcp_gbps:>6.2f} {r.vs_memcpy:>7.2f} {r.vs_tcp:>5.2f}  {r.verified and r.one_copy}"
        )
    print(
        "goals at >= 2048 tokens: shm /memcpy >= 0.7 (one single-threaded memcpy of the same bytes), "
        "/tcp >= 2. verified: every block bit-exact, each path as intended."
    )
