"""``kvwire bench transfer``: KV transfer throughput against the link's ceiling, measured in one run.

Llama-3-8B-shaped KV (32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks) moves from a paged
source cache to a paged destination cache **through the serving code path**: two P/D worker
connectors (``KvwireWorkerConnector``, what the built-in engine and the vLLM plugin run) with real
transfer agents. D binds a receive of the request's blocks, P binds a send and saves each layer as
its forward would (``save_kv_layer``); the agents move the blocks the plane's fastest way (TCP: the
blocks' byte spans, in place). The clock runs from P's bind to both connectors reporting the request
finished (every layer acknowledged). Every byte of the destination blocks is then compared with the
source. Baseline in the same run: ``copy`` (gather each layer, ``send_layer``, scatter in a sink: the
agent's generic API). Ceiling: a raw loopback socket moving the same number of bytes (``sendall`` ->
``recv_into`` a preallocated buffer) in the same process.

``--backend nccl`` runs ``kvwire.bench.transfer_nccl`` (GPU machines), ``--backend shm``
:mod:`kvwire.bench.transfer_shm` (shared memory vs memcpy vs TCP), ``--backend ipc``
:mod:`kvwire.bench.transfer_ipc` (CUDA IPC, two processes on one GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import platform
import socket
import sys
import threading
import time
import uuid

import torch
from prometheus_client import CollectorRegistry

from kvwire.bench.waiting import RECEIVED, SENT, wait_transfer
from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.metadata import KvwireConnectorMetadata, RecvSpec, SendSpec
from kvwire.connector.metrics import connector_metrics
from kvwire.connector.worker import KvwireWorkerConnector
from kvwire.protocol.kv_params import Role
from kvwire.transfer import Backend, LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer.enums import KVLayout, Transport
from kvwire.transfer.memory import (
    block_ids_tensor,
    gather_blocks,
    gathered_shape,
    scatter_blocks,
    shared_tensors,
)
from kvwire.transfer.planes.common.wire import recv_exact
from kvwire.transfer.planes.tcp.wire import tensor_bytes, tune

DEFAULT_TOKENS = (512, 2048, 8192)
_CEILING_JOIN_S = 10.0  # the writer is done once the reader has every byte; this only guards a bug
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shape:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


@dataclasses.dataclass
class SizeResult:
    tokens: int
    num_bytes: int
    seconds: float  # best of the repeats, through the P/D connectors (the serving path)
    gbps: float
    ceiling_seconds: float  # best raw-socket time for the same bytes
    ceiling_gbps: float
    ratio: float  # gbps / ceiling_gbps
    verified: bool  # every destination block equals its source block, bit for bit (both paths)
    copy_seconds: float  # best time with gather_blocks + send_layer + sink scatter_blocks (copies)
    copy_gbps: float
    copy_ratio: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.TCP.value)
    parser.add_argument(
        "--tokens", type=int, nargs="+", action="extend", help="prompt tokens per size; default 512 2048 8192"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per variant and size (best is kept)"
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--shm-ring-mib", type=int, default=None, help="--backend shm: ring per link (default: the config's)"
    )
    parser.add_argument(
        "--shm-copy-threads",
        type=int,
        default=None,
        help="--backend shm: threads copying a layer on the one-copy path (default: the config's)",
    )
    _add_nccl_arguments(parser)


def _add_nccl_arguments(parser: argparse.ArgumentParser) -> None:
    """The NCCL benchmark's own options (used with --backend nccl), where that module exists."""
    try:
        module = importlib.import_module("kvwire.bench.transfer_nccl")
    except ImportError:
        return
    extra = argparse.ArgumentParser(add_help=False)
    module.add_arguments(extra)
    group = parser.add_argument_group("--backend nccl options")
    for action in extra._actions:
        if action.option_strings and not any(
            o in parser._option_string_actions for o in action.option_strings
        ):
            group._add_action(action)


def run(args: argparse.Namespace) -> int:
    if args.backend in (Backend.SHM.value, Backend.IPC.value):
        module = importlib.import_module(f"kvwire.bench.transfer_{args.backend}")
        code: int = module.run(args)
        return code
    if args.backend == Backend.NCCL.value:
        try:
            module = importlib.import_module("kvwire.bench.transfer_nccl")
        except ModuleNotFoundError as exc:
            print(f"kvwire bench transfer: the NCCL benchmark is not available ({exc})", file=sys.stderr)
            return 2
        result: int = module.run(args)
        return result
    shape = Shape(num_layers=args.layers)
    results = [measure(tokens, shape, max(1, args.repeats)) for tokens in (args.tokens or DEFAULT_TOKENS)]
    if args.json:
        print(json.dumps(_as_json(results, shape)))
    else:
        _print_table(results, shape)
    return 0 if all(r.verified for r in results) else 1


class _Caches:
    """Source and destination paged caches with the request's blocks scattered among others."""

    def __init__(self, tokens: int, shape: Shape, *, shared: bool = False) -> None:
        """``shared``: both caches in shared memory, allocated as the built-in engine allocates its
        CPU KV cache (``kvwire.transfer.memory``)."""
        gen = torch.Generator().manual_seed(tokens)
        self.num_blocks = -(-tokens // shape.block_size)
        total = self.num_blocks + max(16, self.num_blocks // 4)
        layer_shape = (2, total, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.src = [torch.randn(layer_shape, generator=gen).to(shape.dtype) for _ in range(shape.num_layers)]
        if shared:
            shared_src = shared_tensors([layer_shape] * shape.num_layers, shape.dtype)
            self.src = [t.copy_(s) for t, s in zip(shared_src, self.src, strict=True)]
            self.dst = shared_tensors([layer_shape] * shape.num_layers, shape.dtype)
        else:
            self.dst = [torch.zeros(layer_shape, dtype=shape.dtype) for _ in range(shape.num_layers)]
        # the request's blocks: scattered among others, in no particular order, different on each side
        self.src_ids: list[int] = torch.randperm(total, generator=gen)[: self.num_blocks].tolist()
        self.dst_ids: list[int] = torch.randperm(total, generator=gen)[: self.num_blocks].tolist()
        self.src_ids_t = block_ids_tensor(self.src_ids, "cpu")
        self.dst_ids_t = block_ids_tensor(self.dst_ids, "cpu")
        payload = gathered_shape(self.src[0], self.num_blocks, KVLayout.KV_FIRST)
        # gather targets: the agent keeps each layer's tensor until the transfer completes
        # one flat buffer (also the ceiling's source) viewed as per-layer stages
        self.flat_stage = torch.empty(shape.num_layers * math.prod(payload), dtype=shape.dtype)
        self.stage = [chunk.view(payload) for chunk in self.flat_stage.chunk(shape.num_layers)]
        self.spec = LayerSpec(payload, shape.dtype)

    @property
    def num_bytes(self) -> int:
        return self.spec.num_bytes * len(self.src)

    def verify(self) -> bool:
        for src, dst in zip(self.src, self.dst, strict=True):
            want = src.index_select(1, self.src_ids_t).view(torch.int16)
            if not torch.equal(dst.index_select(1, self.dst_ids_t).view(torch.int16), want):
                return False
        return True


class _ConnectorPair:
    """A P and a D worker connector over real agents, on the benchmark's caches (the serving path)."""

    def __init__(self, cfg: TransferConfig, caches: _Caches, shape: Shape) -> None:
        info = EngineInfo(block_size=shape.block_size, device="cpu", kv_layout=KVLayout.KV_FIRST)
        metrics = connector_metrics(CollectorRegistry())
        self.p = KvwireWorkerConnector(
            ConnectorConfig(role=Role.PREFILL), info, TransferAgent(cfg), metrics=metrics
        )
        self.d = KvwireWorkerConnector(
            ConnectorConfig(role=Role.DECODE), info, TransferAgent(cfg), metrics=metrics
        )
        self.p.register_kv_caches(caches.src)
        self.d.register_kv_caches(caches.dst)
        self.caches = caches

    def transfer_once(self) -> float:
        """One request's KV as a prefill instance hands it over and a decode instance loads it."""
        rid = tid = uuid.uuid4().hex
        caches = self.caches
        recv = RecvSpec(rid, tid, tuple(caches.dst_ids), 120.0, pull_from=(), want_trailer=False)
        send = SendSpec(rid, tid, (self.d.kv_endpoint,), tuple(caches.src_ids), 120.0, with_trailer=False)
        self.d.bind_connector_metadata(KvwireConnectorMetadata(recvs=(recv,)))
        self.d.clear_connector_metadata()
        start = time.perf_counter()
        self.p.bind_connector_metadata(KvwireConnectorMetadata(sends=(send,)))
        for index, layer in enumerate(caches.src):  # the forward's layers, in order
            self.p.save_kv_layer(index, layer)
        self.p.wait_for_save()
        self.p.clear_connector_metadata()
        sent = recvd = False
        deadline = time.monotonic() + 120.0
        while not (sent and recvd):
            p_out, d_out = self.p.get_finished(set()), self.d.get_finished(set())
            if p_out.failed or d_out.failed or d_out.invalid_block_ids:
                raise RuntimeError(f"transfer failed: {p_out.failed or d_out.failed or 'invalid blocks'}")
            sent = sent or rid in p_out.finished_sending
            recvd = recvd or rid in d_out.finished_recving
            if time.monotonic() > deadline:
                raise TimeoutError("benchmark transfer did not complete within 120 s")
            time.sleep(0.0002)
        return time.perf_counter() - start

    def close(self) -> None:
        self.p.close()
        self.d.close()


def _copy_once(sender: TransferAgent, receiver: TransferAgent, caches: _Caches) -> float:
    """The baseline: ``gather_blocks`` -> ``send_layer`` -> sink ``scatter_blocks``, per layer."""
    tid = uuid.uuid4().hex
    n = len(caches.src)
    layout = KVLayout.KV_FIRST

    def sink(index: int, data: torch.Tensor) -> None:
        scatter_blocks(caches.dst[index], caches.dst_ids_t, data, layout)

    start = time.perf_counter()
    receiver.expect(tid, num_layers=n, sink=sink, deadline_s=120.0)
    sender.start_send(tid, receiver.endpoint, [caches.spec] * n, deadline_s=120.0)
    for i in range(n):
        gather_blocks(caches.src[i], caches.src_ids_t, layout, out=caches.stage[i])
        sender.send_layer(tid, i, caches.stage[i])
    wait_transfer(sender, tid, SENT)  # asleep between events: polling would take the planes' core
    wait_transfer(receiver, tid, RECEIVED)
    return time.perf_counter() - start


def _send_or_hang_up(sock: socket.socket, payload: memoryview) -> None:
    """The ceiling's writer: ``sendall``, or on failure close our side so the reader sees EOF (no hang)."""
    try:
        sock.sendall(payload)
    except OSError:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        raise


def _ceiling_once(src: torch.Tensor, dst: torch.Tensor, buffer_bytes: int) -> float:
    """Raw loopback socket: one thread ``sendall``s ``src``, this one ``recv_into``s ``dst``."""
    server = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(server.getsockname()[:2])
    conn, _ = server.accept()
    for sock in (out, conn):
        tune(sock, buffer_bytes)  # the data plane's socket options
    payload, target = tensor_bytes(src), tensor_bytes(dst)
    writer = threading.Thread(target=_send_or_hang_up, args=(out, payload), name="kvwire-bench-ceiling")
    start = time.perf_counter()
    writer.start()
    recv_exact(conn, target)  # bounded: the writer sends everything or hangs up (EOF here)
    elapsed = time.perf_counter() - start
    writer.join(timeout=_CEILING_JOIN_S)
    for sock in (out, conn, server):
        sock.close()
    return elapsed


def measure(tokens: int, shape: Shape, repeats: int) -> SizeResult:
    caches = _Caches(tokens, shape)
    budget = max(256 * MiB, 4 * caches.spec.num_bytes)
    cfg = TransferConfig(recv_budget_bytes=budget, spill_budget_bytes=0, transport=Transport.TCP)
    times: dict[str, list[float]] = {"zero_copy": [], "copy": [], "ceiling": []}
    verified = True
    flat_dst = torch.empty(caches.num_bytes, dtype=torch.uint8)  # the ceiling's destination
    pair = _ConnectorPair(cfg, caches, shape)
    with TransferAgent(cfg) as sender, TransferAgent(cfg) as receiver, contextlib.closing(pair):

        def once(zero_copy: bool) -> float:
            return pair.transfer_once() if zero_copy else _copy_once(sender, receiver, caches)

        for zero_copy in (True, False):  # warm-up: connections, buffer pools, page faults
            once(zero_copy)
        caches.flat_stage.view(torch.uint8).copy_(torch.randint_like(flat_dst, 0, 255))
        # interleaved, so that load from other processes hits every variant alike; best of each
        for rep in range(repeats + 1):
            last = rep == repeats
            for zero_copy in (True, False):
                if last:
                    for dst in caches.dst:
                        dst.zero_()
                t = once(zero_copy)
                if last:
                    verified = verified and caches.verify()
                else:
                    times["zero_copy" if zero_copy else "copy"].append(t)
            if not last:
                times["ceiling"].append(_ceiling_once(caches.flat_stage, flat_dst, cfg.socket_buffer_bytes))
    best = {k: min(v) for k, v in times.items()}
    ceiling = best["ceiling"]
    gbps, copy_gbps, ceiling_gbps = (
        caches.num_bytes / best[k] / 1e9 for k in ("zero_copy", "copy", "ceiling")
    )
    return SizeResult(
        tokens=tokens,
        num_bytes=caches.num_bytes,
        seconds=best["zero_copy"],
        gbps=gbps,
        ceiling_seconds=ceiling,
        ceiling_gbps=ceiling_gbps,
        ratio=gbps / ceiling_gbps,
        verified=verified,
        copy_seconds=best["copy"],
        copy_gbps=copy_gbps,
        copy_ratio=copy_gbps / ceiling_gbps,
    )


def _as_json(results: list[SizeResult], shape: Shape) -> dict[str, object]:
    return {
        "benchmark": "transfer",
        "backend": Backend.TCP.value,
        "shape": {**dataclasses.asdict(shape), "dtype": str(shape.dtype)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": [dataclasses.asdict(r) for r in results],
    }


def _print_table(results: list[SizeResult], shape: Shape) -> None:
    print(
        f"KV transfer, TCP loopback: {shape.num_layers} layers x [2, tokens, {shape.num_kv_heads}, "
        f"{shape.head_dim}] {str(shape.dtype).removeprefix('torch.')}, paged (block {shape.block_size}) "
        "-> P connector -> agents -> D connector -> paged"
    )
    print(
        f"{'tokens':>7} {'MiB':>7} {'ms':>8} {'GB/s':>6} {'ratio':>6} {'copy ms':>8} {'copy GB/s':>9} "
        f"{'ratio':>6} {'ceiling ms':>10} {'ceiling GB/s':>12}  verified"
    )
    for r in results:
        print(
            f"{r.tokens:>7} {r.num_bytes / MiB:>7.1f} {r.seconds * 1e3:>8.2f} {r.gbps:>6.2f} {r.ratio:>6.2f} "
            f"{r.copy_seconds * 1e3:>8.2f} {r.copy_gbps:>9.2f} {r.copy_ratio:>6.2f} "
            f"{r.ceiling_seconds * 1e3:>10.2f} {r.ceiling_gbps:>12.2f}  {r.verified}"
        )
    print(
        "serving path (first columns): P/D worker connectors over real agents; the blocks travel as byte"
        " spans (sendmsg/recvmsg_into iovecs, no copy);"
    )
    print(
        "copy: gather_blocks -> send_layer -> sink scatter_blocks; ceiling: raw socket sendall -> recv_into."
    )
