"""Captured sends (kvwire.transfer.planes.nccl.graphs) across two GPUs in two processes.

One sender sends transfers of one shape again and again from the same cache, block ids and slab, with
new cache contents each time: the first two go out from Python, the third is captured, later ones
are replays. In between: a cancelled transfer (dummy bytes from Python between two replays), a broken
producer (its capture is given up, it fails on the Python path), and finally the receiver dies while
a replay waits for it: the stall watchdog must fail the peer and the plane must still close (NCCL
does not abort a communicator that a live graph holds).
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from support.nccl_planes import child_results, two_gpus

MiB = 1 << 20
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")]

SHAPE = (2, 1100, 16, 8, 128)  # one KV_FIRST layer (69 MiB)
LAYERS = 6
# 1024 blocks: 64 MiB per gathered layer, 384 MiB per transfer (far more than NCCL's FIFOs hold, so a
# send to a dead receiver stalls instead of completing into its buffers)
BLOCKS = torch.randperm(1100, generator=torch.Generator().manual_seed(7))[:1024].tolist()
LAYER_BYTES = 2 * len(BLOCKS) * 16 * 8 * 128 * 2
GOOD = ["g0", "g1", "g2", "g3", "g4"]  # Python, Python (seen), capture + replay, replay, replay


def _cfg() -> Any:
    from kvwire.transfer.planes.nccl.plane import NcclPlaneConfig

    # 2 layers per message, no edges: 3 messages per transfer; short stall so a dead peer shows fast
    return NcclPlaneConfig(chunk_bytes=2 * LAYER_BYTES, edge_bytes=0, stall_timeout_s=4.0)


def _cache(seed: int, device: str) -> list[torch.Tensor]:
    """Random KV made on ``device`` (same seed, same bits on either H200: Philox with the same launch
    shape). Never called while this process has receives posted (a first kernel load would wait)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randint(-(2**15), 2**15, SHAPE, dtype=torch.int16, generator=gen, device=device).view(
            torch.bfloat16
        )
        for _ in range(LAYERS)
    ]


def _expected(seed: int) -> torch.Tensor:
    from kvwire.transfer.memory import KVLayout, gather_blocks

    ids = torch.tensor(BLOCKS, device="cuda:1")
    cache = _cache(seed, "cuda:1")
    return torch.stack([gather_blocks(c, ids, KVLayout.KV_FIRST) for c in cache]).view(torch.int16)


def _recv(conn: Connection, _: Any) -> dict[str, Any]:
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, "recv-g", _cfg())
    peer = h.peer_ref("send-g")
    slab = plane.allocate_zero_copy(LAYER_BYTES * LAYERS)  # received in place (zero-copy)
    exact: dict[str, bool] = {}

    def receive(tid: str, seed: int) -> None:
        slab.zero_()
        torch.cuda.synchronize(1)
        conn.send(h.post_layers(plane, peer, tid, [LAYER_BYTES] * LAYERS, slab))
        rec.wait_received(tid, LAYERS, timeout_s=30.0)
        got = slab.view(torch.int16).view(LAYERS, -1)
        exact[tid] = bool(torch.equal(got, _expected(seed).view(LAYERS, -1)))

    for seed, tid in enumerate(GOOD):
        receive(tid, seed)
    conn.send(h.post_layers(plane, peer, "cancelled", [LAYER_BYTES] * LAYERS, slab))
    rec.wait_for(lambda: "cancelled" in rec.failed, 30.0)
    receive("after-cancel", 10)
    for tid in ("broken-1", "broken-2"):
        conn.send(h.post_layers(plane, peer, tid, [LAYER_BYTES] * LAYERS, slab))
        rec.wait_for(lambda tid=tid: tid in rec.failed, 30.0)  # type: ignore[misc]
    receive("after-broken", 11)
    conn.send(h.post_layers(plane, peer, "doomed", [LAYER_BYTES] * LAYERS, slab))
    conn.send(exact)
    assert conn.recv() == "die"
    conn.send(os.getpid())
    os._exit(0)  # mid-transfer, like kill -9: the sender's replay waits for a receiver that is gone


def _send(conn: Connection, _: Any) -> dict[str, Any]:
    from kvwire.transfer.enums import KVLayout
    from kvwire.transfer.memory import SendItem
    from kvwire.transfer.planes.common.group_kernels import PagedLayers, SlabGather
    from support import nccl_planes as h

    plane, rec = h.start_plane(0, "send-g", _cfg())
    peer = h.peer_ref("recv-g")
    cache = _cache(0, "cuda:0")
    paged = PagedLayers(cache, KVLayout.KV_FIRST)
    ids = torch.tensor(BLOCKS, dtype=torch.int64, device="cuda:0")
    # the plane's zero-copy memory: sent in place, so a run of messages can be captured
    slab = h.zero_copy_slab(plane, paged.shape(len(BLOCKS)))
    gather = SlabGather(paged, ids, slab)
    stats: dict[str, dict[str, int]] = {}

    def send(tid: str, seed: int | None, producer: Any = gather, cancel: bool = False) -> None:
        plane.on_peer_info(peer, conn.recv())  # the grant: chunk plans
        if seed is not None:
            for layer, fresh in zip(cache, _cache(seed, "cuda:0"), strict=True):
                layer.copy_(fresh)  # same addresses, new contents
        ready = torch.cuda.Event()
        ready.record()
        if cancel:
            plane.cancel(tid)
        plane.send(peer, [SendItem(tid, i, slab[i], ready, on_device=producer) for i in range(LAYERS)])

    for seed, tid in enumerate(GOOD):
        send(tid, seed)
        rec.wait_sent(tid, LAYERS, timeout_s=30.0)
        stats[tid] = plane.send_graph_stats()
    send("cancelled", None, cancel=True)  # dummy bytes from Python, between replays
    send("after-cancel", 10)
    rec.wait_sent("after-cancel", LAYERS, timeout_s=30.0)
    stats["after-cancel"] = plane.send_graph_stats()

    other = torch.empty_like(slab)  # another slab: another key, so a capture is attempted on sight 2

    class Broken(SlabGather):
        def __call__(self, items: Any) -> None:
            raise RuntimeError("producer bug (on purpose)")

    broken = Broken(paged, ids, other)
    for tid in ("broken-1", "broken-2"):
        send(tid, None, producer=broken)
        rec.wait_for(lambda tid=tid: tid in rec.failed, 30.0)  # type: ignore[misc]
    stats["broken"] = plane.send_graph_stats()
    send("after-broken", 11)
    rec.wait_sent("after-broken", LAYERS, timeout_s=30.0)
    stats["after-broken"] = plane.send_graph_stats()

    plane.on_peer_info(peer, conn.recv())  # "doomed" granted
    exact = conn.recv()
    conn.send("die")
    h.wait_process_gone(conn.recv())  # its CUDA context is gone: the posted receives with it
    ready = torch.cuda.Event()
    ready.record()
    plane.send(peer, [SendItem("doomed", i, slab[i], ready, on_device=gather) for i in range(LAYERS)])
    stats["doomed-sent"] = plane.send_graph_stats()  # a hit: replayed on this thread, right here
    started = time.monotonic()
    rec.wait_for(lambda: "recv-g" in rec.peer_failed, 30.0)
    detected_s = time.monotonic() - started
    stats["doomed"] = plane.send_graph_stats()
    started = time.monotonic()
    plane.close()  # resets the graphs, then aborts: must not wait forever
    close_s = time.monotonic() - started
    return {
        "exact": exact,
        "stats": stats,
        "failed": {k: v for k, v in rec.failed.items()},
        "doomed_sent": rec.sent["doomed"],
        "detected_s": detected_s,
        "close_s": close_s,
    }


@pytest.mark.timeout(300)
def test_send_graphs_capture_once_replay_bit_exact_and_survive_a_dead_peer(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_send, 0, left)
    receiver = spawn(_recv, 1, right)
    right.close()  # the sender sees EOF when the receiver dies
    results = child_results(spawn.queue, 1, timeout_s=240.0)
    receiver.join(timeout=30)
    result = results["_send"]
    stats = result["stats"]
    # every transfer bit-exact, whether it went out from Python or as a replay
    assert result["exact"] == {tid: True for tid in [*GOOD, "after-cancel", "after-broken"]}
    # g0 (not connected yet) and g1 (first sighting) from Python; captured once at g2; replays after
    assert [stats[t]["captures"] for t in GOOD] == [0, 0, 1, 1, 1]
    assert [stats[t]["replays"] for t in GOOD] == [0, 0, 1, 2, 3]
    assert stats["after-cancel"]["replays"] == 4 and stats["after-cancel"]["captures"] == 1
    # the broken producer: seen, then its capture was given up; both transfers failed, nothing lost
    assert stats["broken"]["aborted"] == 1 and stats["broken"]["captures"] == 1
    assert result["failed"]["broken-1"].startswith("mismatch: device producer")
    assert result["failed"]["broken-2"].startswith("mismatch: device producer")
    assert stats["after-broken"]["replays"] == 5
    # the dead peer: the replay stalls, the watchdog fails the peer, close() returns
    assert stats["doomed-sent"]["replays"] == 6 and stats["doomed"]["replays"] == 6  # kept after close
    assert result["doomed_sent"] < LAYERS
    assert result["detected_s"] < 20.0
    assert result["close_s"] < 20.0
