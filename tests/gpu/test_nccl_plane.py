"""NCCL data plane across two GPUs in two processes (run with ``pytest -m gpu`` on a 2-GPU machine).

The parent only orchestrates; each scenario is a pair of functions run in spawned processes that talk
over a pipe, playing the agent's part (see ``tests/support/nccl_planes.py``). Data is generated on the
CPU from a seed on both sides, so the receiver can check every byte.
"""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from support.nccl_planes import child_results, two_gpus

MiB = 1 << 20

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")]


def _data(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for size in sizes]


def _gpu(tensors: list[torch.Tensor], rank: int = 0) -> list[torch.Tensor]:
    out = [t.to(f"cuda:{rank}") for t in tensors]
    torch.cuda.synchronize(rank)
    return out


def _cfg(**kw: Any) -> Any:
    from kvwire.transfer.planes.nccl.plane import NcclPlaneConfig

    return NcclPlaneConfig(chunk_bytes=kw.pop("chunk_bytes", 1 * MiB), **kw)


# transfers of the bit-exact test: (id, layer sizes, receive into one slab?, receive into host memory?)
TRANSFERS = [
    ("small-layers", [100 * 1024 + 7] * 40, False, False),  # coalesced, staged on both sides
    ("odd-big-layers", [3 * MiB + 1] * 5, False, False),  # one message per layer
    ("slab", [256 * 1024] * 16, True, False),  # in place on the receiver
    ("host-spill", [512 * 1024] * 4, False, True),  # pinned host destinations
]


def _recv_bit_exact(conn: Connection, lanes: int) -> dict[str, bool]:
    from kvwire.transfer.memory import RecvItem
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, "recv-1", _cfg(lanes=lanes))  # the receiver's offer sets the lanes
    peer = h.peer_ref("send-0")
    dests: dict[str, list[torch.Tensor]] = {}
    for seed, (tid, sizes, slab, host) in enumerate(TRANSFERS):
        if slab:
            flat = plane.allocate(sum(sizes))
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            views = [flat[o : o + s] for o, s in zip(offsets, sizes, strict=True)]
        elif host:
            views = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in sizes]
        else:
            views = [plane.allocate(s) for s in sizes]
        dests[tid] = views
        plane.post_recv(
            peer, [RecvItem(tid, i, s, v) for i, (s, v) in enumerate(zip(sizes, views, strict=True))]
        )
        conn.send((seed, plane.local_info(peer)))
    ok = {}
    for seed, (tid, sizes, _, _) in enumerate(TRANSFERS):
        rec.wait_received(tid, len(sizes))
        got = [d.cpu() for d in dests[tid]]
        ok[tid] = all(torch.equal(a, b) for a, b in zip(got, _data(seed, sizes), strict=True))
    conn.send("done")
    plane.close()
    return ok


def _send_bit_exact(conn: Connection, _: Any) -> tuple[int, int]:
    from support import nccl_planes as h

    plane, rec = h.start_plane(0, "send-0", _cfg())  # default lanes: follows the receiver's offer
    peer = h.peer_ref("recv-1")
    for _ in TRANSFERS:
        _, info = conn.recv()
        plane.on_peer_info(peer, info)

    def send(seed: int) -> None:  # layers of each transfer from their own thread, last transfer first
        tid, sizes, _, _ = TRANSFERS[seed]
        h.send_layers(plane, peer, tid, _gpu(_data(seed, sizes)))

    threads = [threading.Thread(target=send, args=(seed,)) for seed in reversed(range(len(TRANSFERS)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for tid, sizes, _, _ in TRANSFERS:
        rec.wait_sent(tid, len(sizes))
    assert conn.recv() == "done"
    assert not rec.failed and not rec.peer_failed and not rec.protocol_errors
    lanes = len(plane._sender(peer.instance_id).comms)
    plane.close()
    return lanes, plane.num_communicators()


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_bit_exact_concurrent_transfers(spawn: Any, lanes: int) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_send_bit_exact, 0, left)
    spawn(_recv_bit_exact, 1, right, lanes)
    results = child_results(spawn.queue, 2)
    assert results["_recv_bit_exact"] == {tid: True for tid, *_ in TRANSFERS}
    # the sender joined the receiver's lanes; close() dropped every channel
    assert results["_send_bit_exact"] == (lanes, 0)


def _recv_abort(conn: Connection, _: Any) -> dict[str, Any]:
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, "recv-a", _cfg())
    peer = h.peer_ref("send-a")
    bufs = {tid: plane.allocate(4 * MiB) for tid in ("doomed", "next", "after")}
    for tid in ("doomed", "next"):
        conn.send(h.post_layers(plane, peer, tid, [MiB] * 4, bufs[tid]))
    assert conn.recv() == "cancelled"
    plane.cancel("doomed")
    rec.wait_received("next", 4)
    conn.send(h.post_layers(plane, peer, "after", [MiB] * 4, bufs["after"]))
    rec.wait_received("after", 4)
    ok = all(
        torch.equal(bufs[t].cpu(), torch.cat(_data(s, [MiB] * 4))) for s, t in ((1, "next"), (2, "after"))
    )
    result = {
        "exact": ok,
        "doomed_received": rec.received["doomed"],
        "doomed_failed": rec.failed.get("doomed", "peer_aborted"),
        "peer_failed": dict(rec.peer_failed),
    }
    conn.send("done")
    plane.close()
    return result


def _send_abort(conn: Connection, _: Any) -> None:
    from support import nccl_planes as h

    plane, rec = h.start_plane(0, "send-a", _cfg())
    peer = h.peer_ref("recv-a")
    plane.on_peer_info(peer, conn.recv())
    plane.on_peer_info(peer, conn.recv())
    h.send_layers(plane, peer, "doomed", _gpu(_data(0, [MiB] * 2)))  # half of it, then cancel
    plane.cancel("doomed")  # its announced chunks still go out (dummy bytes): "next" must not shift
    conn.send("cancelled")
    h.send_layers(plane, peer, "next", _gpu(_data(1, [MiB] * 4)))
    plane.on_peer_info(peer, conn.recv())
    h.send_layers(plane, peer, "after", _gpu(_data(2, [MiB] * 4)))
    rec.wait_sent("after", 4)
    assert rec.sent["doomed"] <= 2
    assert conn.recv() == "done"
    plane.close()


def test_abort_keeps_the_stream_in_step(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_send_abort, 0, left)
    spawn(_recv_abort, 1, right)
    result = child_results(spawn.queue, 2)["_recv_abort"]
    assert result["exact"] is True and result["peer_failed"] == {}
    assert result["doomed_received"] <= 2  # dummy chunks are never reported as received
    assert result["doomed_failed"].startswith("peer_aborted")


def _recv_then_die(conn: Connection, instance: str) -> None:
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, instance, _cfg())
    peer = h.peer_ref("send-k")
    if instance.endswith("killed"):
        warm = plane.allocate(MiB)
        conn.send(h.post_layers(plane, peer, "warm", [MiB], warm))
        big = plane.allocate(2 * DEAD_LAYER_BYTES)  # more than NCCL's FIFOs: the sender must block
        conn.send(h.post_layers(plane, peer, "dead", [DEAD_LAYER_BYTES] * 2, big))
        rec.wait_received("warm", 1)  # the communicator is up
        assert conn.recv() == "die"
        conn.send(os.getpid())
        os._exit(0)  # no close, no goodbye: like kill -9 mid-transfer
    buf = plane.allocate(8 * MiB)
    conn.send(h.post_layers(plane, peer, "again", [2 * MiB] * 4, buf))
    rec.wait_received("again", 4)
    conn.send(bool(torch.equal(buf.cpu(), torch.cat(_data(5, [2 * MiB] * 4)))))
    assert conn.recv() == "done"
    plane.close()


DEAD_LAYER_BYTES = 256 * MiB


def _send_to_dying_then_restarted(conn: Connection, second: Connection) -> dict[str, Any]:
    import time

    from support import nccl_planes as h

    plane, rec = h.start_plane(0, "send-k", _cfg(stall_timeout_s=3.0))
    old = h.peer_ref("recv-killed")
    plane.on_peer_info(old, conn.recv())
    plane.on_peer_info(old, conn.recv())
    h.send_layers(plane, old, "warm", _gpu(_data(4, [MiB])))
    rec.wait_sent("warm", 1)
    conn.send("die")
    # its receives of "dead" are posted: only once its CUDA context is gone can they take no data
    # (the driver may still run them for a while after the process has exited)
    pid = conn.recv()
    h.wait_process_gone(pid)
    h.wait_gpu_released(pid)
    big = torch.empty(DEAD_LAYER_BYTES, dtype=torch.uint8, device="cuda:0")
    h.send_layers(plane, old, "dead", [big, big])
    started = time.monotonic()
    try:
        rec.wait_for(lambda: "recv-killed" in rec.peer_failed, 30.0)
    except Exception as exc:  # say what the plane did with the doomed chunks
        raise AssertionError(
            f"dead peer not detected: sent={rec.sent['dead']} trace={plane.chunk_trace()[-4:]}"
        ) from exc
    detected_s = time.monotonic() - started
    plane.drop_peer("recv-killed")  # what the agent does on peer loss / a new epoch (idempotent here)
    new = h.peer_ref("recv-restarted")
    plane.on_peer_info(new, second.recv())  # the restarted peer's first grant (a new communicator)
    h.send_layers(plane, new, "again", _gpu(_data(5, [2 * MiB] * 4)))
    rec.wait_sent("again", 4)
    exact = second.recv()
    second.send("done")
    plane.close()
    return {"detected_s": detected_s, "restarted_exact": exact, "dead_sent": rec.sent["dead"]}


def test_peer_killed_then_restarted(spawn: Any) -> None:
    a0, a1 = spawn.ctx.Pipe()
    b0, b1 = spawn.ctx.Pipe()
    spawn(_send_to_dying_then_restarted, 0, a0, b0)
    dying = spawn(_recv_then_die, 1, a1, "recv-killed")
    a1.close()  # so the sender sees EOF when the receiver dies
    dying.join(timeout=120)
    assert dying.exitcode == 0
    spawn(_recv_then_die, 1, b1, "recv-restarted")
    results = child_results(spawn.queue, 2)
    result = results["_send_to_dying_then_restarted"]
    assert result["restarted_exact"] is True
    assert result["dead_sent"] < 2  # never both layers "sent" into a dead process
    assert result["detected_s"] < 20.0


# --- device consumers: gated scatters enqueued behind the receive -------------------------------------------
CONSUMER_SHAPE = (2, 64, 16, 8, 128)  # one KV_FIRST layer: [2, blocks, block_size, kv_heads, head_dim]
CONSUMER_LAYERS = 6
SRC_BLOCKS = [3, 60, 7, 21, 40, 11, 0, 33]
DST_BLOCKS = {
    "landed": [1, 2, 9, 30, 31, 50, 63, 12],
    "disarmed": [4, 5, 6, 8, 10, 13, 14, 15],
    "dummy": [16, 17, 18, 19, 20, 22, 23, 24],
    "after": [25, 26, 27, 28, 29, 32, 34, 35],
}


def _src_cache(seed: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-(2**15), 2**15, CONSUMER_SHAPE, dtype=torch.int16, generator=gen)
        .view(torch.bfloat16)
        .to(device)
        for _ in range(CONSUMER_LAYERS)
    ]


def _step(side: str, what: str) -> None:
    """Progress marker on stderr (pytest shows it on failure; ``-s`` shows it live)."""
    print(f"[consumers {side}] {what}", file=sys.stderr, flush=True)


def _recv_consumers(conn: Connection, _: Any) -> dict[str, Any]:
    from kvwire.transfer.enums import KVLayout
    from kvwire.transfer.memory import RecvItem
    from kvwire.transfer.planes.common.group_kernels import PagedLayers
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, "recv-c", _cfg(chunk_bytes=1 * MiB, edge_bytes=0, stall_timeout_s=20.0))
    assert plane.supports_device_consumers
    peer = h.peer_ref("send-c")
    cache = [
        torch.zeros(CONSUMER_SHAPE, dtype=torch.bfloat16, device="cuda:1") for _ in range(CONSUMER_LAYERS)
    ]
    _step("recv", "plane up; compiling and loading the kernels")
    paged = PagedLayers(cache, KVLayout.KV_FIRST)
    assert paged.gated_scatter
    _step("recv", "kernels loaded")
    calls: dict[str, int] = {}

    def post(tid: str) -> bytes:
        ids = torch.tensor(DST_BLOCKS[tid], device="cuda:1")
        slab = torch.empty(paged.shape(ids.numel()), dtype=torch.bfloat16, device="cuda:1")

        def consume(items: Any, gate: torch.Tensor) -> None:
            start, stop = items[0].layer_index, items[-1].layer_index + 1
            paged.scatter(ids, slab[start:stop], start, stop, gate=gate)
            calls[tid] = calls.get(tid, 0) + 1

        size = slab[0].numel() * 2
        flat = slab.view(-1).view(torch.uint8)
        items = [
            RecvItem(tid, i, size, flat[i * size : (i + 1) * size], on_device=consume)
            for i in range(CONSUMER_LAYERS)
        ]
        plane.post_recv(peer, items)
        return plane.local_info(peer)

    conn.send(post("landed"))
    _step("recv", "landed posted")
    rec.wait_received("landed", CONSUMER_LAYERS, timeout_s=30.0)  # only after its scatters ran
    _step("recv", "landed received")
    for tid in ("disarmed", "dummy"):  # the communicator is warm: posted (and armed) right here
        conn.send(post(tid))
    plane.cancel("disarmed")  # before any byte of it came: its scatters must write nothing
    _step("recv", "disarmed cancelled")
    conn.send("disarmed")
    rec.wait_for(lambda: "dummy" in rec.failed, 30.0)  # the sender cancelled it: dummy bytes
    _step("recv", "dummy failed as expected")
    conn.send(post("after"))
    rec.wait_received("after", CONSUMER_LAYERS, timeout_s=30.0)
    torch.cuda.synchronize(1)
    got = {tid: torch.stack([c[:, ids] for c in cache]).cpu() for tid, ids in DST_BLOCKS.items()}
    conn.send("done")
    plane.close()
    src = [c.cpu() for c in _src_cache(0, "cpu")]
    src2 = [c.cpu() for c in _src_cache(1, "cpu")]
    want = torch.stack([c[:, SRC_BLOCKS] for c in src]).view(torch.int16)
    want2 = torch.stack([c[:, SRC_BLOCKS] for c in src2]).view(torch.int16)
    return {
        "landed": bool(torch.equal(got["landed"].view(torch.int16), want)),
        "after": bool(torch.equal(got["after"].view(torch.int16), want2)),
        "disarmed_untouched": bool(not got["disarmed"].view(torch.int16).any()),
        "dummy_untouched": bool(not got["dummy"].view(torch.int16).any()),
        "dummy_failed": rec.failed.get("dummy", ""),
        "disarmed_received": rec.received["disarmed"],
        "calls": calls,
    }


def _send_consumers(conn: Connection, _: Any) -> None:
    from kvwire.transfer.memory import KVLayout, gather_blocks
    from support import nccl_planes as h

    plane, rec = h.start_plane(0, "send-c", _cfg(chunk_bytes=1 * MiB, edge_bytes=0, stall_timeout_s=20.0))
    peer = h.peer_ref("recv-c")
    ids = torch.tensor(SRC_BLOCKS, device="cuda:0")
    cache = _src_cache(0, "cuda:0")
    layers = [gather_blocks(c, ids, KVLayout.KV_FIRST) for c in cache]
    torch.cuda.synchronize(0)  # no ready events: the bytes must be in place before the plane sends
    _step("send", "waiting for the first grant")
    plane.on_peer_info(peer, conn.recv())
    h.send_layers(plane, peer, "landed", layers)
    _step("send", "landed handed over")
    for _ in range(2):
        plane.on_peer_info(peer, conn.recv())
    assert conn.recv() == "disarmed"
    h.send_layers(plane, peer, "disarmed", layers)  # real bytes: the receiver's gates are off
    plane.cancel("dummy")  # never sends it: dummy bytes with a "not real" status
    plane.on_peer_info(peer, conn.recv())
    after = [gather_blocks(c, ids, KVLayout.KV_FIRST) for c in _src_cache(1, "cuda:0")]
    torch.cuda.synchronize(0)
    h.send_layers(plane, peer, "after", after)
    rec.wait_sent("after", CONSUMER_LAYERS)
    _step("send", "after sent")
    assert conn.recv() == "done"
    plane.close()


@pytest.mark.timeout(300)  # compiles three Triton kernel variants in the receiver first
def test_device_consumers_scatter_on_arrival_and_gates_hold(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_send_consumers, 0, left)
    spawn(_recv_consumers, 1, right)
    result = child_results(spawn.queue, 2, timeout_s=240.0)["_recv_consumers"]
    assert result["landed"] is True and result["after"] is True
    assert result["disarmed_untouched"] is True and result["disarmed_received"] == 0
    assert result["dummy_untouched"] is True and result["dummy_failed"].startswith("peer_aborted")
    assert result["calls"]["landed"] == CONSUMER_LAYERS * 512 * 1024 // MiB  # one scatter per message


# --- device producers: the plane gathers each message on its send stream just before sending it ----------
PRODUCER_TRANSFERS = ("gathered", "broken", "after-broken")


def _recv_producers(conn: Connection, _: Any) -> dict[str, Any]:
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, "recv-p", _cfg(chunk_bytes=1 * MiB, edge_bytes=0, stall_timeout_s=20.0))
    peer = h.peer_ref("send-p")
    size = 2 * len(SRC_BLOCKS) * 16 * 8 * 128 * 2  # one gathered KV_FIRST layer, bytes
    slabs = {}
    for tid in PRODUCER_TRANSFERS:
        slabs[tid] = plane.allocate(size * CONSUMER_LAYERS)
        conn.send(h.post_layers(plane, peer, tid, [size] * CONSUMER_LAYERS, slabs[tid]))
    rec.wait_received("gathered", CONSUMER_LAYERS, timeout_s=30.0)
    rec.wait_for(lambda: "broken" in rec.failed, 30.0)
    rec.wait_received("after-broken", CONSUMER_LAYERS, timeout_s=30.0)
    want = {seed: _gathered_src(seed) for seed in (0, 1)}
    got = {tid: slabs[tid].cpu().view(torch.int16) for tid in ("gathered", "after-broken")}
    conn.send("done")
    plane.close()
    return {
        "gathered": bool(torch.equal(got["gathered"], want[0])),
        "after_broken": bool(torch.equal(got["after-broken"], want[1])),
        "broken_failed": rec.failed.get("broken", ""),
        "broken_received": rec.received["broken"],
    }


def _gathered_src(seed: int) -> torch.Tensor:
    """What the receiver must get: each layer's SRC_BLOCKS, gathered (KV_FIRST), as int16 words."""
    from kvwire.transfer.memory import KVLayout, gather_blocks

    ids = torch.tensor(SRC_BLOCKS)
    return (
        torch.stack([gather_blocks(c, ids, KVLayout.KV_FIRST) for c in _src_cache(seed, "cpu")])
        .view(torch.int16)
        .reshape(-1)
    )


def _send_producers(conn: Connection, _: Any) -> dict[str, Any]:
    from kvwire.transfer.enums import KVLayout
    from kvwire.transfer.memory import SendItem
    from kvwire.transfer.planes.common.group_kernels import PagedLayers
    from support import nccl_planes as h

    plane, rec = h.start_plane(0, "send-p", _cfg(chunk_bytes=1 * MiB, edge_bytes=0, stall_timeout_s=20.0))
    assert plane.supports_device_producers
    peer = h.peer_ref("recv-p")
    ids = torch.tensor(SRC_BLOCKS, device="cuda:0")
    calls: dict[str, list[int]] = {}

    def send(tid: str, seed: int, broken: bool = False) -> None:
        cache = _src_cache(seed, "cuda:0")
        paged = PagedLayers(cache, KVLayout.KV_FIRST)
        slab = torch.full(paged.shape(len(SRC_BLOCKS)), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        ready = torch.cuda.Event()
        ready.record()  # the cache is written (in serving: after each layer's compute)

        def produce(items: Any) -> None:
            start, stop = items[0].layer_index, items[-1].layer_index + 1
            calls.setdefault(tid, []).append(stop - start)
            if broken:
                raise RuntimeError("producer bug (on purpose)")
            paged.gather(ids, slab[start:stop], start, stop)

        items = [SendItem(tid, i, slab[i], ready, on_device=produce) for i in range(CONSUMER_LAYERS)]
        plane.send(peer, items)

    for _ in PRODUCER_TRANSFERS:
        plane.on_peer_info(peer, conn.recv())
    send("gathered", 0)
    send("broken", 1, broken=True)
    send("after-broken", 1)
    rec.wait_sent("gathered", CONSUMER_LAYERS)
    rec.wait_sent("after-broken", CONSUMER_LAYERS)
    rec.wait_for(lambda: "broken" in rec.failed, 30.0)
    assert conn.recv() == "done"
    plane.close()
    return {"calls": calls, "broken_failed": rec.failed.get("broken", ""), "broken_sent": rec.sent["broken"]}


def test_device_producers_gather_each_message_before_it_is_sent(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_send_producers, 0, left)
    spawn(_recv_producers, 1, right)
    results = child_results(spawn.queue, 2, timeout_s=240.0)
    recv, send = results["_recv_producers"], results["_send_producers"]
    assert recv["gathered"] is True and recv["after_broken"] is True  # bit-exact, in place
    assert recv["broken_failed"].startswith("peer_aborted") and recv["broken_received"] == 0
    assert send["broken_failed"].startswith("mismatch: device producer") and send["broken_sent"] == 0
    layer_bytes = 2 * len(SRC_BLOCKS) * 16 * 8 * 128 * 2
    per_message = max(1, MiB // layer_bytes)
    # one producer call per message, each with that message's layers
    assert send["calls"]["gathered"] == [
        min(per_message, CONSUMER_LAYERS - i) for i in range(0, CONSUMER_LAYERS, per_message)
    ]
