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
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench import nccl_harness as h
from kvwire.transfer.cuda_paged import PagedLayers
from kvwire.transfer.nccl_lib import NcclComm
from kvwire.transfer.paged import KVLayout, gather_blocks, scatter_blocks

LAYOUT = KVLayout.KV_FIRST


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
def ceiling(conn: Connection, rank: int, comm: NcclComm, num_bytes: int, iters: int) -> list[float]:
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


# --- (c) kvwire: grouped one-launch gathers, coalesced grouped NCCL messages, one-launch scatters ----------
class KvwireSide:
    """One side of the kvwire path: a plane, its peer, and the per-size buffers."""

    def __init__(self, rank: int, plane_cfg: h.NcclPlaneConfig, tag: str) -> None:
        self.rank = rank
        self.plane, self.rec = h.start_plane(rank, f"bench-{tag}-r{rank}", plane_cfg)
        self.peer = h.peer_ref(f"bench-{tag}-r{1 - rank}")
        self.chunk_bytes = plane_cfg.chunk_bytes
        self.gather_stream = torch.cuda.Stream()
        self.seq = 0

    def groups(self, num_layers: int, layer_bytes: int) -> list[range]:
        per = max(1, self.chunk_bytes // layer_bytes)
        return [range(s, min(s + per, num_layers)) for s in range(0, num_layers, per)]

    def send_handshake(self, conn: Connection) -> str:
        """Rank 0: offer a transfer; the grant brings the receiver's chunk plan (and, the first time,
        its communicator). In serving this round trip overlaps the prefill, so it is not timed."""
        tid = f"t{self.seq}"
        self.seq += 1
        conn.send(("offer", tid))
        self.plane.on_peer_info(self.peer, conn.recv())
        return tid

    def send_data(self, tid: str, paged: PagedLayers, ids: torch.Tensor, slab: torch.Tensor) -> None:
        """Rank 0: gather group by group (one launch each, on the gather stream), hand layers over."""
        self.gather_stream.wait_stream(torch.cuda.current_stream())
        for group in self.groups(len(paged.layers), slab[0].numel() * 2):
            with torch.cuda.stream(self.gather_stream):
                paged.gather(ids, slab[group.start : group.stop], group.start, group.stop)
                ready = torch.cuda.Event()
                ready.record(self.gather_stream)
            layers = [slab[i] for i in group]
            h.send_layers(self.plane, self.peer, tid, layers, [ready] * len(group), first_layer=group.start)

    def recv_handshake(
        self, conn: Connection, paged: PagedLayers, ids: torch.Tensor, slab: torch.Tensor
    ) -> tuple[str, list[torch.cuda.Event]]:
        """Rank 1: post every layer (back to back in ``slab``) and grant; each coalesced message is
        scattered (one launch) on the plane's delivery stream as soon as it lands."""
        _, tid = conn.recv()
        num_layers = len(paged.layers)
        groups = self.groups(num_layers, slab[0].numel() * 2)
        group_of = {layer: g for g, group in enumerate(groups) for layer in group}
        left = [len(group) for group in groups]
        done: list[torch.cuda.Event] = []

        def on_layer(transfer_id: str, layer: int) -> None:  # completer thread, delivery stream current
            g = group_of[layer]
            left[g] -= 1
            if left[g] == 0:
                group = groups[g]
                paged.scatter(ids, slab[group.start : group.stop], group.start, group.stop)
                event = torch.cuda.Event()
                event.record()
                done.append(event)

        self.rec.on_layer = on_layer
        sizes = [slab[0].numel() * 2] * num_layers
        conn.send(h.post_layers(self.plane, self.peer, tid, sizes, slab.view(-1).view(torch.uint8)))
        return tid, done

    def recv_finish(self, tid: str, num_layers: int, done: list[torch.cuda.Event]) -> None:
        self.rec.wait_received(tid, num_layers)
        for event in done:
            event.synchronize()
        self.rec.on_layer = None

    def close(self) -> None:
        self.plane.close()


def kvwire_path(
    conn: Connection, side: KvwireSide, paged: PagedLayers, ids: torch.Tensor, iters: int
) -> list[float]:
    """(c): from "every layer is in the sender's cache" to "every layer is in the receiver's cache"."""
    slab = torch.empty(paged.shape(ids.numel()), dtype=torch.bfloat16, device=ids.device)
    num_layers = len(paged.layers)
    out = []
    for _ in range(iters):
        if side.rank == 0:
            tid = side.send_handshake(conn)
            barrier(conn, 0)
            t0 = time.perf_counter()
            side.send_data(tid, paged, ids, slab)
            out.append(conn.recv() - t0)
            side.rec.wait_sent(tid, num_layers)
        else:
            tid, done = side.recv_handshake(conn, paged, ids, slab)
            barrier(conn, 1)
            side.recv_finish(tid, num_layers, done)
            conn.send(time.perf_counter())
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
    return {"ms": round(ms, 4), "gbps": round(num_bytes / (ms * 1e-3) / 1e9, 1), "iters": len(samples)}
