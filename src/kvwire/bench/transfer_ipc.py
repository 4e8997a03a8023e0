"""``kvwire bench transfer --backend ipc``: the CUDA IPC plane, two processes on one GPU, against a
device-to-device copy of the same bytes in one process (same run). Needs one CUDA GPU.

Workload as :mod:`kvwire.bench.transfer` (Llama-3-8B-shaped paged KV, the request's blocks scattered
differently in both caches), moved paged -> paged as byte spans: the sender's plane copies P's blocks
straight into D's granted blocks. Two clocks, best of ``--repeats`` each:

* ``copy``: the device time of the plane's copies (CUDA events around each batch's launches, summed
  by the agent as ``device_copy_ns``): what the plane's mover achieves, comparable to the baseline;
* ``e2e``: ``start_send`` to ``finished_sending`` on P (offer, grant, copies, DONE, D's ack over the
  control plane): adds the host's share, a fixed cost per transfer that the copy does not have.

D checks every destination block of the last run. Baseline: one contiguous ``copy_`` of the same
number of bytes on the same GPU, device time, behind the same launch gate as the plane's batches
(:mod:`kvwire.transfer.planes.ipc.gate`: neither window counts the host's launch). Goal (issue 17):
copy >= 0.8 of the baseline at >= 2048 tokens, >= 0.5 at 512.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
import time
import uuid
from multiprocessing.connection import Connection

import torch

from kvwire.bench.transfer import MiB, Shape
from kvwire.bench.waiting import RECEIVED, SENT, wait_transfer
from kvwire.transfer.config import TransferConfig

DEFAULT_TOKENS = (512, 2048, 8192)
OVERLAP_TOKENS = 2048
DEVICE = "cuda:0"


@dataclasses.dataclass(frozen=True)
class Where:
    """Device and plane of both agents: one GPU over CUDA IPC for the benchmark; the CPU unit test runs
    the same two-process flow on CPU over TCP."""

    device: str = DEVICE
    transport: str = "ipc"

    def config(self) -> TransferConfig:
        from kvwire.transfer import TransferConfig

        return TransferConfig(
            device=self.device,
            transport=self.transport,  # type: ignore[arg-type]
            default_deadline_s=120.0,
        )

    def synchronize(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)


GPU = Where()


@dataclasses.dataclass
class IpcResult:
    tokens: int
    num_bytes: int
    ipc_seconds: float  # e2e
    ipc_gbps: float
    copy_seconds: float  # device time of the plane's copies
    copy_gbps: float
    d2d_seconds: float  # one contiguous device-to-device copy of the same bytes, one process
    d2d_gbps: float
    ratio: float  # copy / d2d (the goal's ratio)
    e2e_ratio: float  # e2e / d2d
    verified: bool
    batches: int = 0  # the plane's timed batches (launch windows) in the best copy run


def _ids(tokens: int, shape: Shape, seed: int) -> tuple[int, list[int]]:
    num_blocks = -(-tokens // shape.block_size)
    total = num_blocks + max(16, num_blocks // 4)
    gen = torch.Generator().manual_seed(seed)
    return total, torch.randperm(total, generator=gen)[:num_blocks].tolist()


def _layer_shape(total: int, shape: Shape) -> tuple[int, ...]:
    return (2, total, shape.block_size, shape.num_kv_heads, shape.head_dim)


def _receiver(conn: Connection, tokens: int, shape: Shape, runs: int, verify: bool, where: Where) -> None:
    """D: expects each transfer (then says so), waits for it, answers the time it became whole (one
    host: P reads the same clock); with ``verify``, checks every block of the last run at the end."""
    from kvwire.transfer import TransferAgent
    from kvwire.transfer.memory import KVLayout, block_spans, gather_blocks

    if where.device.startswith("cuda"):
        torch.cuda.set_device(where.device)
    total, dst_ids = _ids(tokens, shape, 2)
    _, src_ids = _ids(tokens, shape, 1)
    dst = [
        torch.zeros(_layer_shape(total, shape), dtype=shape.dtype, device=where.device)
        for _ in range(shape.num_layers)
    ]
    with TransferAgent(where.config()) as agent:
        conn.send(agent.endpoint)
        for _ in range(runs):
            tid = conn.recv()
            agent.expect(
                tid,
                num_layers=shape.num_layers,
                scatter_into=lambda i: block_spans(dst[i], dst_ids, KVLayout.KV_FIRST),
            )
            conn.send("expecting")  # the clock starts once D waits for the transfer, as in serving
            wait_transfer(agent, tid, RECEIVED)
            conn.send(time.perf_counter())
        assert conn.recv() == "done"  # P saw every acknowledgement: D's agent may close now
        if verify:
            verified = True
            gen = torch.Generator().manual_seed(tokens)
            for layer in range(shape.num_layers):
                src = torch.randn(_layer_shape(total, shape), generator=gen).to(shape.dtype)
                want = gather_blocks(src, torch.tensor(src_ids), KVLayout.KV_FIRST)
                got = gather_blocks(dst[layer].cpu(), torch.tensor(dst_ids), KVLayout.KV_FIRST)
                verified = verified and torch.equal(want.view(torch.int16), got.view(torch.int16))
            conn.send(verified)


def _sender(
    conn: Connection, tokens: int, shape: Shape, runs: int, where: Where
) -> list[tuple[float, float, int]]:
    from kvwire.transfer import LayerSpec, TransferAgent
    from kvwire.transfer.memory import KVLayout, block_spans

    total, src_ids = _ids(tokens, shape, 1)
    gen = torch.Generator().manual_seed(tokens)
    src = [
        torch.randn(_layer_shape(total, shape), generator=gen).to(shape.dtype).to(where.device)
        for _ in range(shape.num_layers)
    ]
    spans = [block_spans(t, src_ids, KVLayout.KV_FIRST) for t in src]
    spec = LayerSpec((spans[0].num_bytes,), torch.uint8)
    times = []
    with TransferAgent(where.config()) as agent:
        peer = conn.recv()
        for _ in range(runs):
            tid = uuid.uuid4().hex
            conn.send(tid)
            assert conn.recv() == "expecting"
            where.synchronize()
            before = agent.stats()
            start = time.perf_counter()
            agent.start_send(tid, peer, [spec] * shape.num_layers)
            for layer, s in enumerate(spans):
                agent.send_layer_spans(tid, layer, s)
            wait_transfer(agent, tid, SENT, timeout_s=60.0)
            elapsed, after = time.perf_counter() - start, agent.stats()
            copy_s = (after.device_copy_ns - before.device_copy_ns) / 1e9
            times.append((elapsed, copy_s, after.device_copy_batches - before.device_copy_batches))
            conn.recv()  # D's time of completion (not needed here)
        conn.send("done")
    return times


@dataclasses.dataclass
class OverlapResult:
    """Layer-wise sends during a synthetic forward on the same GPU: how long the KV took to be whole on
    D after P's forward ended (``exposed``), against one layer's compute (goal: exposed <= it)."""

    tokens: int
    forward_ms: float  # the forward alone
    forward_with_transfer_ms: float  # the forward while the plane copies its layers (same GPU)
    layer_compute_ms: float
    exposed_ms: float  # D has every layer this long after P's forward ended (median)
    goal_met: bool


def overlap(tokens: int, shape: Shape, iters: int = 6) -> OverlapResult:
    """P runs a Llama-3-8B-sized forward on ``tokens`` and hands each layer to the plane as soon as it
    is written (``send_layer_spans`` with the layer's event, as the connector does); D, another
    process on the same GPU, receives into its paged caches."""
    from kvwire.bench.synthetic_forward import SyntheticForward
    from kvwire.transfer import LayerSpec, TransferAgent
    from kvwire.transfer.memory import KVLayout, block_spans

    ctx = mp.get_context("spawn")
    left, right = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(right, tokens, shape, iters, False, GPU), daemon=True)
    receiver.start()
    try:
        total, src_ids = _ids(tokens, shape, 1)
        cache = [
            torch.zeros(_layer_shape(total, shape), dtype=shape.dtype, device=DEVICE)
            for _ in range(shape.num_layers)
        ]
        ids = torch.tensor(src_ids, device=DEVICE)
        spans = [block_spans(t, src_ids, KVLayout.KV_FIRST) for t in cache]
        spec = LayerSpec((spans[0].num_bytes,), torch.uint8)
        fwd = SyntheticForward(-(-tokens // shape.block_size) * shape.block_size, torch.device(DEVICE))
        alone = []
        for _ in range(iters):
            start, end = fwd.run(cache, ids)
            end.synchronize()
            alone.append(start.elapsed_time(end))
        exposed, with_transfer = [], []
        with TransferAgent(GPU.config()) as agent:
            peer = left.recv()
            for _ in range(iters):
                tid = uuid.uuid4().hex
                left.send(tid)
                assert left.recv() == "expecting"
                agent.start_send(tid, peer, [spec] * shape.num_layers)

                def save(layer: int, written: torch.cuda.Event, tid: str = tid) -> None:
                    agent.send_layer_spans(tid, layer, spans[layer], ready_event=written)

                start, end = fwd.run(cache, ids, save)
                end.synchronize()
                compute_done = time.perf_counter()
                exposed.append(left.recv() - compute_done)
                with_transfer.append(start.elapsed_time(end))
                # P's side ends too (D's acks) before the next one
                wait_transfer(agent, tid, SENT, timeout_s=60.0)
            left.send("done")
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    forward_ms = statistics.median(alone[1:])
    layer_ms = forward_ms / shape.num_layers
    exposed_ms = statistics.median(exposed[1:]) * 1e3
    return OverlapResult(
        tokens,
        round(forward_ms, 3),
        round(statistics.median(with_transfer[1:]), 3),
        round(layer_ms, 4),
        round(exposed_ms, 4),
        exposed_ms <= layer_ms,
    )


def _d2d(num_bytes: int, repeats: int, device: str) -> float:
    """Best device time of one contiguous copy, timed as the plane times a batch: behind the launch
    gate, so neither figure counts the host's launch."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    if not device.startswith("cuda"):
        for _ in range(repeats):
            start_s = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start_s)
        return best
    from kvwire.transfer.planes.ipc.gate import LaunchGate

    stream = torch.cuda.Stream(device)
    gate = LaunchGate()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), gate.held(stream):
            start.record(stream)
            dst.copy_(src)
            end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure(tokens: int, shape: Shape, repeats: int, where: Where = GPU) -> IpcResult:
    ctx = mp.get_context("spawn")
    left, right = ctx.Pipe()
    runs = repeats + 1  # the first maps the receiver's memory (warm-up)
    receiver = ctx.Process(target=_receiver, args=(right, tokens, shape, runs, True, where), daemon=True)
    receiver.start()
    try:
        times = _sender(left, tokens, shape, runs, where)
        verified = bool(left.recv())
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    num_blocks = -(-tokens // shape.block_size)
    num_bytes = 2 * num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    num_bytes *= shape.num_layers
    ipc_s = min(t for t, _, _ in times[1:])
    copy_s, batches = min((c, b) for _, c, b in times[1:])
    d2d_s = _d2d(num_bytes, max(3, repeats), where.device)
    return IpcResult(
        tokens,
        num_bytes,
        ipc_s,
        num_bytes / ipc_s / 1e9,
        copy_s,
        num_bytes / copy_s / 1e9 if copy_s > 0 else 0.0,
        d2d_s,
        num_bytes / d2d_s / 1e9,
        d2d_s / copy_s if copy_s > 0 else 0.0,
        d2d_s / ipc_s,
        verified,
        batches,
    )


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("kvwire bench transfer --backend ipc: needs a CUDA GPU")
        return 2
    shape = Shape(num_layers=args.layers)
    results = [measure(t, shape, max(1, args.repeats)) for t in (args.tokens or DEFAULT_TOKENS)]
    lw = overlap(OVERLAP_TOKENS, shape)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "transfer",
                    "backend": "ipc",
                    "results": [dataclasses.asdict(r) for r in results],
                    "overlap": dataclasses.asdict(lw),
                }
            )
        )
    else:
        print(
            f"KV transfer over CUDA IPC, two processes on one GPU, {shape.num_layers} layers, paged -> paged"
        )
        print(
            f"{'tokens':>7} {'MiB':>7} {'copy ms':>8} {'GB/s':>7} {'e2e ms':>8} {'GB/s':>7} "
            f"{'d2d ms':>8} {'GB/s':>7} {'copy/d2d':>8} {'e2e/d2d':>8} {'batches':>7}  verified"
        )
        for r in results:
            print(
                f"{r.tokens:>7} {r.num_bytes / MiB:>7.1f} {r.copy_seconds * 1e3:>8.3f} {r.copy_gbps:>7.1f} "
                f"{r.ipc_seconds * 1e3:>8.3f} {r.ipc_gbps:>7.1f} {r.d2d_seconds * 1e3:>8.3f} "
                f"{r.d2d_gbps:>7.1f} {r.ratio:>8.2f} {r.e2e_ratio:>8.2f} {r.batches:>7}  {r.verified}"
            )
        print(
            "copy: device time of the plane's copies; e2e: start_send -> finished_sending (control plane "
            "included); d2d: one contiguous copy of the same bytes in one process (goal: copy/d2d >= 0.8 "
            "at >= 2048 tokens, >= 0.5 at 512)"
        )
        print(
            f"layer-wise overlap @{lw.tokens} tokens (P's forward and the copies on one GPU): forward "
            f"{lw.forward_ms} ms alone, {lw.forward_with_transfer_ms} ms while sending; layer compute "
            f"{lw.layer_compute_ms} ms; KV whole on D {lw.exposed_ms} ms after the forward ended "
            f"(goal <= one layer: {'met' if lw.goal_met else 'NOT met'})"
        )
    return 0 if all(r.verified for r in results) else 1
