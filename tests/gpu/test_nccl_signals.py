"""Armed sends (SendItem.ready_signal, kvwire.transfer.planes.nccl.device_signal) across two GPUs.

The sender hands each transfer over *before* its data exists, then writes the KV on its compute
stream and fires the signal there: the receiver must get the data written after the hand-over (a
plane that did not wait would gather the old contents). The runs go from Python first, then as
graph replays. A transfer cancelled while armed releases the stream and fails on the receiver; one
that is never fired does not keep close() from returning.
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

SHAPE = (2, 200, 16, 8, 128)  # one KV_FIRST layer
LAYERS = 4
BLOCKS = torch.randperm(200, generator=torch.Generator().manual_seed(3))[:96].tolist()
LAYER_BYTES = 2 * len(BLOCKS) * 16 * 8 * 128 * 2  # 6 MiB
FIRED = ["f0", "f1", "f2", "f3"]  # Python (not connected), Python (seen), capture + replay, replay


def _cfg() -> Any:
    from kvwire.transfer.planes.nccl.plane import NcclPlaneConfig

    return NcclPlaneConfig(chunk_bytes=2 * LAYER_BYTES, edge_bytes=0, stall_timeout_s=20.0)


def _cache(seed: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randint(-(2**15), 2**15, SHAPE, dtype=torch.int16, generator=gen, device=device).view(
            torch.bfloat16
        )
        for _ in range(LAYERS)
    ]


def _recv(conn: Connection, _: Any) -> dict[str, Any]:
    from kvwire.transfer.memory import KVLayout, gather_blocks
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, "recv-s", _cfg())
    peer = h.peer_ref("send-s")
    slab = plane.allocate_zero_copy(LAYER_BYTES * LAYERS)  # received in place (zero-copy)
    ids = torch.tensor(BLOCKS, device="cuda:1")
    exact: dict[str, bool] = {}
    for index, tid in enumerate(FIRED):
        conn.send(h.post_layers(plane, peer, tid, [LAYER_BYTES] * LAYERS, slab))
        rec.wait_received(tid, LAYERS, timeout_s=30.0)
        want = torch.stack([gather_blocks(c, ids, KVLayout.KV_FIRST) for c in _cache(100 + index, "cuda:1")])
        exact[tid] = bool(torch.equal(slab.view(torch.int16), want.view(torch.int16).view(-1)))
    conn.send(h.post_layers(plane, peer, "abandoned", [LAYER_BYTES] * LAYERS, slab))
    rec.wait_for(lambda: "abandoned" in rec.failed, 30.0)
    conn.send(h.post_layers(plane, peer, "after", [LAYER_BYTES] * LAYERS, slab))
    rec.wait_received("after", LAYERS, timeout_s=30.0)
    conn.send(h.post_layers(plane, peer, "never", [LAYER_BYTES] * LAYERS, slab))
    conn.send(exact)
    assert conn.recv() == "closed"
    plane.close()
    return {
        "abandoned": rec.failed["abandoned"],
        "after": rec.received["after"],
        "never": rec.received["never"],
    }


def _send(conn: Connection, _: Any) -> dict[str, Any]:
    from kvwire.transfer.enums import KVLayout
    from kvwire.transfer.memory import SendItem
    from kvwire.transfer.planes.common.group_kernels import PagedLayers, SlabGather
    from kvwire.transfer.planes.nccl.device_signal import DeviceSignal, SignalState
    from support import nccl_planes as h

    plane, rec = h.start_plane(0, "send-s", _cfg())
    assert plane.supports_device_signals
    peer = h.peer_ref("recv-s")
    cache = _cache(0, "cuda:0")
    paged = PagedLayers(cache, KVLayout.KV_FIRST)
    ids = torch.tensor(BLOCKS, dtype=torch.int64, device="cuda:0")
    # the plane's zero-copy memory: sent in place, so a run of messages can be captured
    slab = h.zero_copy_slab(plane, paged.shape(len(BLOCKS)))
    gather = SlabGather(paged, ids, slab)
    compute = torch.cuda.Stream()

    def arm(tid: str) -> DeviceSignal:
        plane.on_peer_info(peer, conn.recv())  # the grant
        signal = DeviceSignal()
        plane.send(
            peer, [SendItem(tid, i, slab[i], ready_signal=signal, on_device=gather) for i in range(LAYERS)]
        )
        return signal

    stats = {}
    for index, tid in enumerate(FIRED):
        signal = arm(tid)  # handed over while the cache still holds the previous contents
        fresh = _cache(100 + index, "cuda:0")
        # never a device-wide sync while a transfer is armed: it would wait for the send stream,
        # which waits for the signal (see device_signal)
        compute.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(compute):  # "the forward": writes the KV, then fires
            for layer, new in zip(cache, fresh, strict=True):
                layer.copy_(new, non_blocking=True)
            signal.fire()
        rec.wait_sent(tid, LAYERS, timeout_s=30.0)
        stats[tid] = plane.send_graph_stats()
    signal = arm("abandoned")
    plane.cancel("abandoned")  # while armed: the stream goes on, the receiver drops the chunks
    abandoned_state = signal.state
    signal = arm("after")
    with torch.cuda.stream(compute):
        signal.fire()
    rec.wait_sent("after", LAYERS, timeout_s=30.0)
    never = arm("never")  # armed, never fired: close() must still return
    exact = conn.recv()
    started = time.monotonic()
    plane.close()
    close_s = time.monotonic() - started
    conn.send("closed")
    return {
        "exact": exact,
        "stats": stats,
        "abandoned_state": int(abandoned_state),
        "abandoned_sent": rec.sent["abandoned"],
        "never_state": int(never.state),
        "close_s": close_s,
        "pid": os.getpid(),
        "abandoned_value": int(SignalState.ABANDONED),
    }


@pytest.mark.timeout(240)
def test_armed_sends_wait_for_the_device_signal(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_send, 0, left)
    spawn(_recv, 1, right)
    results = child_results(spawn.queue, 2, timeout_s=200.0)
    send, recv = results["_send"], results["_recv"]
    # the data written after the hand-over, from Python and from graph replays alike
    assert send["exact"] == {tid: True for tid in FIRED}
    assert [send["stats"][t]["captures"] for t in FIRED] == [0, 0, 1, 1]
    assert [send["stats"][t]["replays"] for t in FIRED] == [0, 0, 1, 2]
    # cancelled while armed: released, "not real" on the wire, the stream in step for the next one
    assert send["abandoned_state"] == send["abandoned_value"] and send["abandoned_sent"] == 0
    assert recv["abandoned"].startswith("peer_aborted") and recv["after"] == LAYERS
    # never fired: close() abandons it and returns
    assert send["never_state"] == send["abandoned_value"] and send["close_s"] < 20.0
    assert recv["never"] == 0
