"""TransferAgents forced to the CUDA IPC plane: two processes on ONE GPU (rank 0 for both).

Bit-exact paged -> paged copies (P's blocks straight into D's granted blocks), a sender killed
mid-transfer (D fails with peer_lost, keeps working), and an epoch change (D restarted: P's next
transfer maps the new process's memory). Written for the lead's single-H200 run; the CPU suite covers
the plane's pure logic (tests/unit/transfer/test_ipc_plane_cpu.py)."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from kvwire.transfer.memory import KVLayout, block_spans, gather_blocks
from support.nccl_planes import child_results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYOUT = KVLayout.KV_FIRST
SHAPE = (2, 64, 16, 8, 128)  # [2, blocks, block_size, kv_heads, head_dim]
LAYERS = 6
SRC_IDS = [5, 17, 2, 40, 41, 42, 9, 61]  # 40..42: one coalesced run
DST_IDS = [0, 1, 63, 30, 31, 32, 8, 50]


def _cache(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-(2**15), 2**15, SHAPE, dtype=torch.int16, generator=gen) for _ in range(LAYERS)]


def _poll(agent: Any, wanted: set[str], field: str, timeout_s: float = 60.0) -> dict[str, str]:
    done: set[str] = set()
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while not wanted <= done | set(failed):
        assert time.monotonic() < deadline, f"timed out; done={done} failed={failed}"
        events = agent.poll()
        done |= getattr(events, field)
        failed.update(events.failed)
        time.sleep(0.005)
    return failed


def _config() -> Any:
    from kvwire.transfer import TransferConfig

    return TransferConfig(device="cuda:0", transport="ipc")


def _send(agent: Any, peer: str, tid: str, cache: list[torch.Tensor], layers: int = LAYERS) -> None:
    from kvwire.transfer import LayerSpec

    spans = [block_spans(t, SRC_IDS, LAYOUT) for t in cache]
    spec = LayerSpec((spans[0].num_bytes,), torch.uint8)
    agent.start_send(tid, peer, [spec] * LAYERS, deadline_s=60.0)
    ready = torch.cuda.Event()
    ready.record()
    for layer in range(layers):  # fewer than announced: the transfer stays in flight
        agent.send_layer_spans(tid, layer, spans[layer], ready_event=ready)


def _sender(conn: Connection, arg: Any) -> dict[str, Any]:
    from kvwire.transfer import TransferAgent

    with TransferAgent(_config()) as agent:
        results: dict[str, Any] = {}
        while (cmd := conn.recv()) != "stop":
            op, peer, tid, seed = cmd
            cache = [t.view(torch.bfloat16).to("cuda:0") for t in _cache(seed)]
            copied_before = agent.stats().device_copy_bytes
            _send(agent, peer, tid, cache, LAYERS if op == "send" else LAYERS // 2)
            if op == "send":
                results[tid] = _poll(agent, {tid}, "finished_sending")
                results["transports"] = agent.peer_transports()
                conn.send(results[tid])
            else:  # "send_and_hang": once the first layers were copied into D, report, then wait to be killed
                deadline = time.monotonic() + 60
                while agent.stats().device_copy_bytes == copied_before:  # Offer and Grant went through
                    assert time.monotonic() < deadline, "no layer copied within 60 s"
                    time.sleep(0.005)
                conn.send("sending")
                time.sleep(120)
        return results


def _receiver(conn: Connection, arg: Any) -> dict[str, Any]:
    from kvwire.transfer import TransferAgent

    with TransferAgent(_config()) as agent:
        conn.send((agent.endpoint, os.getpid()))
        out: dict[str, Any] = {}
        for tid, seed in arg:
            dst = [torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:0") for _ in range(LAYERS)]
            agent.expect(
                tid,
                num_layers=LAYERS,
                scatter_into=lambda i, d=dst: block_spans(d[i], DST_IDS, LAYOUT),
                deadline_s=60.0,
            )
            failed = _poll(agent, {tid}, "finished_recving")
            want = [gather_blocks(t, torch.tensor(SRC_IDS), LAYOUT) for t in _cache(seed)]
            got = [gather_blocks(t.cpu().view(torch.int16), torch.tensor(DST_IDS), LAYOUT) for t in dst]
            out[tid] = {
                "failed": failed,
                "exact": all(torch.equal(a, b) for a, b in zip(want, got, strict=True)),
            }
        return out


def test_two_processes_on_one_gpu_copy_bit_exact(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    p_left, p_right = spawn.ctx.Pipe()
    spawn(_sender, 0, left)
    spawn(_receiver, 0, p_right, [("ipc-a", 1), ("ipc-b", 2)])
    endpoint, _ = p_left.recv()
    for tid, seed in (("ipc-a", 1), ("ipc-b", 2)):
        right.send(("send", endpoint, tid, seed))
        assert right.recv() == {}
    right.send("stop")
    results = child_results(spawn.queue, 2)
    receiver = results["_receiver"]
    assert receiver["ipc-a"] == {"failed": {}, "exact": True} and receiver["ipc-b"] == {
        "failed": {},
        "exact": True,
    }
    assert set(results["_sender"]["transports"].values()) == {"ipc"}


def test_sender_killed_mid_transfer_fails_receiver_with_peer_lost(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    p_left, p_right = spawn.ctx.Pipe()
    sender = spawn(_sender, 0, left)
    spawn(_receiver, 0, p_right, [("ipc-ok", 3), ("ipc-killed", 4)])
    endpoint, _ = p_left.recv()
    right.send(("send", endpoint, "ipc-ok", 3))
    assert right.recv() == {}
    # the next transfer's receiver waits for layers: kill the sender while it is in flight
    right.send(("send_and_hang", endpoint, "ipc-killed", 4))
    assert right.recv() == "sending"
    os.kill(sender.pid, signal.SIGKILL)
    results = child_results(spawn.queue, 1)
    receiver = results["_receiver"]
    assert receiver["ipc-ok"]["exact"] is True
    killed = receiver["ipc-killed"]
    assert killed["failed"]["ipc-killed"].startswith("peer_lost")  # well before the 60 s deadline


def test_receiver_restarted_next_transfer_maps_the_new_epoch(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_sender, 0, left)
    first_l, first_r = spawn.ctx.Pipe()
    spawn(_receiver, 0, first_r, [("epoch-1", 5)])
    endpoint, _ = first_l.recv()
    right.send(("send", endpoint, "epoch-1", 5))
    assert right.recv() == {}
    first = child_results(spawn.queue, 1)["_receiver"]
    assert first["epoch-1"]["exact"] is True
    second_l, second_r = spawn.ctx.Pipe()
    spawn(_receiver, 0, second_r, [("epoch-2", 6)])
    endpoint2, _ = second_l.recv()
    right.send(("send", endpoint2, "epoch-2", 6))
    assert right.recv() == {}
    right.send("stop")
    results = child_results(spawn.queue, 2)
    assert results["_receiver"]["epoch-2"] == {"failed": {}, "exact": True}


def test_launch_gate_holds_the_stream_until_released() -> None:
    """The writer's gate: nothing behind it runs while it is held (so a batch's device window holds
    only GPU work), everything runs once released, and the cyclic count survives its wrap."""
    from kvwire.transfer.planes.ipc.gate import LaunchGate

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    gate = LaunchGate()
    for count in (0, 2**32 - 1):  # the second pass wraps the word to 0
        gate.count = count
        gate._cell.value = count
        with gate.held(stream) as held:
            assert held
            behind = torch.cuda.Event()
            behind.record(stream)
            for _ in range(200):
                assert not behind.query(), "work behind a held gate ran"
        assert gate.count == (count + 1) % 2**32
        deadline = time.monotonic() + 10
        while not behind.query():
            assert time.monotonic() < deadline, "the released gate did not let the stream go"
            time.sleep(0.001)


def test_copy_kernel_launches_through_the_compiled_runner() -> None:
    """After its first (compiling) launch the mover launches through Triton's compiled-kernel runner
    (the JIT entry point costs more host time per batch), bit-exact; a runner that refused the call
    would have switched the module to the JIT path for good."""
    from kvwire.transfer.planes.common.runs import spans_array, tile_runs
    from kvwire.transfer.planes.ipc import copy

    torch.cuda.set_device(0)
    src = [t.cuda() for t in _cache(3)]
    dst = [torch.zeros_like(t) for t in src]
    src_spans = block_spans(src[0], SRC_IDS, LAYOUT).spans
    dst_spans = block_spans(dst[0], DST_IDS, LAYOUT).spans
    tiles = tile_runs(spans_array(src_spans), spans_array(dst_spans), 32 * 1024)
    table = copy.TileTable.build(tiles, src[0].device)
    group = copy.LayerGroup(table, [(s.data_ptr(), d.data_ptr()) for s, d in zip(src, dst, strict=True)])
    anchor = torch.empty(4, dtype=torch.int32, device="cuda")
    for _ in range(3):
        launches = copy.prepare([group], anchor)
        copy.launch(launches, anchor)
    torch.cuda.synchronize()
    assert copy.compiled(launches) and copy._direct[0]
    for s, d in zip(src, dst, strict=True):
        want = gather_blocks(s, torch.tensor(SRC_IDS, device="cuda"), LAYOUT)
        assert torch.equal(want, gather_blocks(d, torch.tensor(DST_IDS, device="cuda"), LAYOUT))
