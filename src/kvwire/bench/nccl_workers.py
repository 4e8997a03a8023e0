"""The two processes of ``kvwire bench transfer --backend nccl``: rank 0 (P, sends) and rank 1 (D).

Timing: rank 0 takes ``t0`` right after a pipe barrier; rank 1 takes ``t1`` once the last byte is
scattered into its paged cache (stream synchronized) and sends it back; both clocks are the host's
``time.perf_counter`` (CLOCK_MONOTONIC, shared by the processes). Every method moves the same bytes:
the selected blocks of every layer of a Llama-3-8B-shaped paged KV cache into other blocks of the
peer's cache (the ceiling moves one contiguous buffer of that size and touches no cache).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench import nccl_harness as h
from kvwire.transfer.memory import KVLayout, RecvItem, SendItem, gather_blocks, scatter_blocks
from kvwire.transfer.planes.common.group_kernels import PagedLayers, SlabGather
from kvwire.transfer.planes.nccl.bindings import NcclComm
from kvwire.transfer.planes.nccl.device_signal import DeviceSignal
from kvwire.transfer.planes.nccl.framing import message_ranges
from kvwire.transfer.planes.nccl.memory import NcclBuffer

LAYOUT = KVLayout.KV_FIRST
SENDERS = ("armed", "producer", "per-message", "bulk")  # how (c)'s sender hands its layers to the plane


@dataclasses.dataclass(frozen=True)
class KVShape:
    """Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, block size 16."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    cache_blocks: int = 1200

    def layer_bytes(self, tokens: int) -> int:
        return 2 * self.blocks(tokens) * self.block_size * self.kv_heads * self.head_dim * 2

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def barrier(conn: Connection, rank: int) -> None:
    if rank == 0:
        conn.send("sync")
        assert conn.recv() == "sync"
    else:
        assert conn.recv() == "sync"
        conn.send("sync")


def make_cache(shape: KVShape, device: torch.device, seed: int) -> list[torch.Tensor]:
    """Random *bits* (every bf16 pattern, NaNs included: compared as int16)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = (2, shape.cache_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    return [
        torch.randint(-(2**15), 2**15, dims, dtype=torch.int16, device=device, generator=gen).view(
            torch.bfloat16
        )
        for _ in range(shape.layers)
    ]


def block_ids(shape: KVShape, tokens: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(shape.cache_blocks, generator=gen)[: shape.blocks(tokens)].to(device)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


# --- (a) ceiling: one contiguous NCCL send of the same bytes ----------------------------------------------
def ceiling(
    conn: Connection, rank: int, comm: NcclComm, num_bytes: int, iters: int, buf: torch.Tensor | None = None
) -> list[float]:
    """(a): one contiguous send of ``num_bytes`` (from/into ``buf`` when given, e.g. a registered one)."""
    if buf is None:
        buf = torch.empty(num_bytes, dtype=torch.uint8, device=torch.cuda.current_device())
    stream = torch.cuda.current_stream()
    out = []
    for _ in range(iters):
        barrier(conn, rank)
        if rank == 0:
            t0 = time.perf_counter()
            comm.send(buf.data_ptr(), num_bytes, 1, stream.cuda_stream)
            h.wait_stream(stream, comm)
            out.append(conn.recv() - t0)
        else:
            comm.recv(buf.data_ptr(), num_bytes, 0, stream.cuda_stream)
            h.wait_stream(stream, comm)
            conn.send(time.perf_counter())
    return out


def registered_ceiling(
    conn: Connection, rank: int, comm: NcclComm, num_bytes: int, iters: int
) -> list[float] | None:
    """(a) between buffers both ranks registered with ``comm`` (None when this NCCL cannot)."""
    if not comm.can_register:
        return None
    with NcclBuffer(num_bytes) as buf:
        handle = comm.register(buf.ptr, num_bytes)
        try:
            return ceiling(conn, rank, comm, num_bytes, iters, buf.tensor)
        finally:
            torch.cuda.synchronize()
            comm.deregister(handle)


def two_lane_ceiling(
    conn: Connection, rank: int, comms: Sequence[NcclComm], num_bytes: int, iters: int
) -> list[float] | None:
    """For reference (the goal's ceiling is (a)): the same bytes as ``len(comms)`` contiguous parts
    sent at once, each on its own communicator and stream, between registered buffers: what (c)'s
    lanes could reach with no gathers, scatters or message boundaries. None when this NCCL cannot
    register buffers."""
    if not all(comm.can_register for comm in comms):
        return None
    streams = [torch.cuda.Stream() for _ in comms]
    part = -(-num_bytes // len(comms) // 256) * 256
    spans = [(i * part, min(part, num_bytes - i * part)) for i in range(len(comms))]
    with NcclBuffer(num_bytes) as buf:
        handles = [(comm, comm.register(buf.ptr, num_bytes)) for comm in comms]
        try:
            out = []
            for _ in range(iters):
                barrier(conn, rank)
                t0 = time.perf_counter()
                for comm, stream, (offset, size) in zip(comms, streams, spans, strict=True):
                    op = comm.send if rank == 0 else comm.recv
                    op(buf.ptr + offset, size, 1 - rank, stream.cuda_stream)
                for stream in streams:
                    h.wait_stream(stream)
                if rank == 0:
                    out.append(conn.recv() - t0)
                else:
                    conn.send(time.perf_counter())
            return out
        finally:
            torch.cuda.synchronize()
            for comm, handle in handles:
                comm.deregister(handle)


# --- (b) the reference's per-layer way ---------------------------------------------------------------------
def reference(
    conn: Connection, rank: int, comm: NcclComm, cache: list[torch.Tensor], ids: torch.Tensor, iters: int
) -> list[float]:
    stream = torch.cuda.current_stream()
    out = []
    for _ in range(iters):
        barrier(conn, rank)
        t0 = time.perf_counter()
        for layer in range(len(cache)):
            if rank == 0:
                data = gather_blocks(cache[layer], ids, LAYOUT)
                conn.send(("layer", layer, tuple(data.shape)))  # control round trip per layer
                assert conn.recv() == "ready"
                comm.send(data.data_ptr(), data.numel() * 2, 1, stream.cuda_stream)
                h.wait_stream(stream, comm)
            else:
                _, _, shape = conn.recv()
                data = torch.empty(shape, dtype=torch.bfloat16, device=ids.device)
                conn.send("ready")
                comm.recv(data.data_ptr(), data.numel() * 2, 0, stream.cuda_stream)
                h.wait_stream(stream, comm)
                scatter_blocks(cache[layer], ids, data, LAYOUT)
                h.wait_stream(stream, comm)
        if rank == 0:
            out.append(conn.recv() - t0)
        else:
            conn.send(time.perf_counter())
    return out


# --- (c) kvwire: one-launch gathers per message, the plane, one-launch gated scatters on arrival ----------
class KvwireSide:
    """One side of the kvwire path: a plane, its peer, and the per-size buffers."""

    def __init__(self, rank: int, plane_cfg: h.NcclPlaneConfig, tag: str, sender: str = "armed") -> None:
        if sender not in SENDERS:
            raise ValueError(f"sender must be one of {SENDERS}, got {sender!r}")
        self.sender = sender
        self.rank = rank
        self.plane, self.rec = h.start_plane(rank, f"bench-{tag}-r{rank}", plane_cfg)
        self.peer = h.peer_ref(f"bench-{tag}-r{1 - rank}")
        self.config = plane_cfg
        self.gather_stream = torch.cuda.Stream()
        self.seq = 0
        self.last_t0 = 0.0  # rank 0: start of the last timed transfer
        self.connected = False  # a transfer went through: the NCCL pair is connected
        self.handoff_us: list[float] = []  # rank 0: host time from t0 until fire()/hand-over returned
        self._row_key: tuple[int, tuple[int, ...]] | None = None
        self._row_views: list[torch.Tensor] = []
        self._slabs: dict[tuple[int, ...], torch.Tensor] = {}  # shape -> zero-copy slab

    def slab(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The slab (bf16, ``shape``) a transfer of that shape gathers into (rank 0) or lands in (rank 1):
        allocated once per shape from the plane's zero-copy memory, as a serving instance keeps one
        per prompt-length bucket, so NCCL moves it in place."""
        if shape not in self._slabs:
            self._slabs[shape] = h.zero_copy_slab(self.plane, shape)
        return self._slabs[shape]

    def trace(self, conn: Connection, last: int) -> list[tuple[Any, ...]]:
        """Both ranks: the plane's last ``last`` chunks of each side, microseconds after the last t0
        (launch start, launched, completion seen); rank 0 gets the rows, rank 1 an empty list."""
        mine = [row for row in self.plane.chunk_trace() if row[1] == self.peer.instance_id][-last:]
        if self.rank == 1:
            conn.send(mine)
            return []
        rows = mine + conn.recv()
        return [
            (kind, seq, nbytes >> 20, *(round((t - self.last_t0) * 1e6) for t in times), round(cpu), steps)
            for kind, _, seq, nbytes, *times, cpu, steps in rows
        ]

    def groups(self, num_layers: int, layer_bytes: int) -> list[range]:
        """The receiver's message framing for a transfer of ``num_layers`` equal layers: the sender
        gathers exactly one message's layers per launch, so each message leaves once its own gather
        is done."""
        sizes = [layer_bytes] * num_layers
        cfg = self.config
        ranges = message_ranges(sizes, cfg.chunk_bytes, cfg.edge_bytes, cfg.ramp, cfg.lanes)
        return [range(a, b) for a, b in ranges]

    def send_handshake(self, conn: Connection) -> str:
        """Rank 0: offer a transfer; the grant brings the receiver's chunk plan (and, the first time,
        its communicator). In serving this round trip overlaps the prefill, so it is not timed."""
        tid = f"t{self.seq}"
        self.seq += 1
        conn.send(("offer", tid))
        self.plane.on_peer_info(self.peer, conn.recv())
        return tid

    def arm(self, tid: str, paged: PagedLayers, ids: torch.Tensor, slab: torch.Tensor) -> DeviceSignal:
        """Rank 0, ``sender="armed"`` (what a P instance does once it knows the request's blocks, i.e.
        before its forward ends): hand every layer over with a device producer *and* a device signal;
        the plane queues the whole transfer on its send stream behind a wait for the signal. The
        caller fires the signal on its stream once the KV is written (the timed start)."""
        signal = DeviceSignal()
        gather = SlabGather(paged, ids, slab)
        rows = self._rows(slab)
        self.plane.send(
            self.peer,
            [SendItem(tid, i, row, ready_signal=signal, on_device=gather) for i, row in enumerate(rows)],
        )
        return signal

    def send_data(self, tid: str, paged: PagedLayers, ids: torch.Tensor, slab: torch.Tensor) -> None:
        """Rank 0. ``sender="producer"`` (what a P instance does): hand every layer over in one call
        with a device producer, so the plane gathers each message (one launch) on its send stream just
        before sending it. ``"per-message"``: gather message by message here (one launch each, on the
        gather stream) and hand each message's layers over as soon as its gather is queued. ``"bulk"``:
        queue every gather first, then hand all layers over in one call."""
        if self.sender == "producer":
            ready = torch.cuda.Event()  # the layers are in the cache (in serving: per layer, by compute)
            ready.record()
            gather = SlabGather(paged, ids, slab)
            items = [SendItem(tid, i, row, ready, on_device=gather) for i, row in enumerate(self._rows(slab))]
            self.plane.send(self.peer, items)
            return
        self.gather_stream.wait_stream(torch.cuda.current_stream())
        pending: list[tuple[range, torch.cuda.Event]] = []
        for group in self.groups(len(paged.layers), slab[0].numel() * 2):
            with torch.cuda.stream(self.gather_stream):
                paged.gather(ids, slab[group.start : group.stop], group.start, group.stop)
                ready = torch.cuda.Event()
                ready.record(self.gather_stream)
            pending.append((group, ready))
            if self.sender == "per-message":
                self._hand_over(tid, slab, pending)
        self._hand_over(tid, slab, pending)

    def _rows(self, slab: torch.Tensor) -> list[torch.Tensor]:
        """The slab's per-layer rows (views made once per slab: a sender's staging buffers and their
        views are set up ahead of any transfer, not per transfer)."""
        key = (slab.data_ptr(), tuple(slab.shape))
        if self._row_key != key:
            self._row_key, self._row_views = key, list(slab.unbind(0))
        return self._row_views

    def _hand_over(self, tid: str, slab: torch.Tensor, pending: list[tuple[range, torch.cuda.Event]]) -> None:
        if pending:
            items = [SendItem(tid, i, slab[i], ready) for group, ready in pending for i in group]
            self.plane.send(self.peer, items)
            pending.clear()

    def recv_handshake(
        self, conn: Connection, paged: PagedLayers, ids: torch.Tensor, slab: torch.Tensor
    ) -> tuple[str, Landing]:
        """Rank 1: post every layer (back to back in ``slab``) with a device consumer that scatters each
        message into the cache (one gated launch, enqueued behind the receive) and grant."""
        _, tid = conn.recv()
        landing = Landing(paged, ids, slab)
        sizes = [slab[0].numel() * 2] * len(paged.layers)
        conn.send(
            h.post_layers(
                self.plane, self.peer, tid, sizes, slab.view(-1).view(torch.uint8), on_device=landing
            )
        )
        return tid, landing

    def recv_finish(self, tid: str, num_layers: int, landing: Landing) -> None:
        """Rank 1, after :meth:`Landing.wait` (the timed part): the plane's per-layer reports."""
        del landing
        self.rec.wait_received(tid, num_layers)

    def close(self) -> None:
        self.plane.close()  # frees the slabs too
        self._slabs.clear()


class Landing:
    """The receiver's device consumer for one transfer: scatter a message's layers from the slab into
    the paged cache with one gated launch; the end is when every message's scatter is done (they may
    run concurrently, see :data:`~kvwire.transfer.memory.DeviceConsumer`)."""

    def __init__(self, paged: PagedLayers, ids: torch.Tensor, slab: torch.Tensor) -> None:
        self.paged = paged
        self.ids = ids
        self.slab = slab
        self.done: list[torch.cuda.Event] = []
        self.enqueued = threading.Event()  # the last layer's scatter is on the GPU's queue

    def __call__(self, items: Sequence[RecvItem], gate: torch.Tensor) -> None:
        start, stop = items[0].layer_index, items[-1].layer_index + 1
        self.paged.scatter(self.ids, self.slab[start:stop], start, stop, gate=gate)
        event = torch.cuda.Event()
        event.record()
        self.done.append(event)
        if stop == len(self.paged.layers):
            self.enqueued.set()

    def wait(self, timeout_s: float = 25.0) -> None:
        if not self.enqueued.wait(timeout_s):
            raise TimeoutError("the last message was never posted")
        for event in self.done:
            event.synchronize()


def kvwire_path(
    conn: Connection, side: KvwireSide, paged: PagedLayers, ids: torch.Tensor, iters: int
) -> list[float]:
    """(c): from "every layer is in the sender's cache" to "every layer is in the receiver's cache"."""
    slab = side.slab(paged.shape(ids.numel()))
    num_layers = len(paged.layers)
    stream = torch.cuda.current_stream()  # the "forward's" stream, known ahead (as (a) takes its own)
    out = []
    for _ in range(iters):
        if side.rank == 0:
            tid = side.send_handshake(conn)
            signal = side.arm(tid, paged, ids, slab) if side.sender == "armed" else None
            barrier(conn, 0)
            t0 = side.last_t0 = time.perf_counter()
            with h.marker("t0"):
                if signal is not None:
                    signal.fire(stream)  # the KV is in the cache: the GPU starts the armed transfer
                else:
                    side.send_data(tid, paged, ids, slab)
            side.handoff_us.append((time.perf_counter() - t0) * 1e6)
            out.append(conn.recv() - t0)
            side.rec.wait_sent(tid, num_layers)
        else:
            tid, landing = side.recv_handshake(conn, paged, ids, slab)
            # the grant's receives are posted (with their scatters) before the data is ready, as in
            # serving, where D grants at the start of P's prefill: wait until they are on the GPU.
            # Not on a new communicator's first transfer: NCCL connects the pair inside the first
            # receive's launch, which waits for the sender's first send (after the barrier).
            if side.connected and not landing.enqueued.wait(timeout=30.0):
                raise TimeoutError("(c): the receiver's messages were not all posted within 30 s")
            barrier(conn, 1)
            landing.wait()
            end = time.perf_counter()
            with h.marker("end"):
                conn.send(end)
            side.recv_finish(tid, num_layers, landing)
            side.connected = True
    return out


def verify(conn: Connection, rank: int, comm: NcclComm, cache: list[torch.Tensor], ids: torch.Tensor) -> bool:
    """Rank 0 sends its blocks (plain torch gather); rank 1 compares them bit for bit with its own."""
    stream = torch.cuda.current_stream()
    mine = torch.stack([gather_blocks(layer, ids, LAYOUT) for layer in cache])
    if rank == 0:
        comm.send(mine.data_ptr(), mine.numel() * 2, 1, stream.cuda_stream)
        h.wait_stream(stream, comm)
        return bool(conn.recv())
    theirs = torch.empty_like(mine)
    comm.recv(theirs.data_ptr(), theirs.numel() * 2, 0, stream.cuda_stream)
    h.wait_stream(stream, comm)
    same = bool(torch.equal(mine.view(torch.int16), theirs.view(torch.int16)))
    conn.send(same)
    return same


def poison(cache: list[torch.Tensor], ids: torch.Tensor) -> None:
    for layer in cache:
        layer.index_fill_(1, ids, 0.0)


def summarize(samples: list[float], num_bytes: int) -> dict[str, Any]:
    ms = median_ms(samples)
    return {
        "ms": round(ms, 4),
        "gbps": round(num_bytes / (ms * 1e-3) / 1e9, 1),
        "iters": len(samples),
        "samples_ms": [round(x * 1e3, 4) for x in samples],
    }
