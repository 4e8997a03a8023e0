"""TransferAgent with the NCCL backend across two GPUs: the whole stack (ZMQ control plane, grants,
chunk plans in plane_info, NCCL data, sink scatter), bit-exact, with concurrent transfers and an abort."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from kvwire.transfer.memory import KVLayout, gather_blocks
from support.nccl_planes import child_results, two_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")]

LAYOUT = KVLayout.KV_FIRST
SHAPE = (2, 64, 16, 8, 128)  # [2, blocks, block_size, kv_heads, head_dim]
LAYERS = 6
TRANSFERS = ["kv-a", "kv-b", "kv-c"]
SRC_IDS = [5, 17, 2, 40, 33, 9, 61]
DST_IDS = [0, 1, 63, 30, 12, 8, 50]


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


def _agent_sender(conn: Connection, _: Any) -> dict[str, str]:
    from kvwire.transfer import Backend, LayerSpec, TransferAgent, TransferConfig
    from kvwire.transfer.planes.common.group_kernels import gather_layers

    with TransferAgent(TransferConfig(backend=Backend.NCCL, transport="nccl", device="cuda:0")) as agent:
        peer = conn.recv()
        ids = torch.tensor(SRC_IDS, device="cuda:0")
        for seed, tid in enumerate(TRANSFERS):
            cache = [t.view(torch.bfloat16).to("cuda:0") for t in _cache(seed)]
            slab = gather_layers(cache, ids, LAYOUT)  # one launch for every layer
            ready = torch.cuda.Event()
            ready.record()
            agent.start_send(tid, peer, [LayerSpec.of(slab[i]) for i in range(LAYERS)], deadline_s=60.0)
            for layer in range(LAYERS):
                agent.send_layer(tid, layer, slab[layer], ready_event=ready)
        doomed = torch.zeros(4, 1024, device="cuda:0")
        agent.start_send("doomed", peer, [LayerSpec.of(doomed)] * 2, deadline_s=60.0)
        agent.send_layer("doomed", 0, doomed)
        agent.abort("doomed", "test abort")
        failed = _poll(agent, set(TRANSFERS), "finished_sending")
        assert conn.recv() == "done"
        return failed


def _agent_receiver(conn: Connection, _: Any) -> dict[str, Any]:
    from kvwire.transfer import Backend, TransferAgent, TransferConfig
    from kvwire.transfer.memory import scatter_blocks

    with TransferAgent(TransferConfig(backend=Backend.NCCL, transport="nccl", device="cuda:1")) as agent:
        conn.send(agent.endpoint)
        ids = torch.tensor(DST_IDS, device="cuda:1")
        dst = {
            tid: [torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:1") for _ in range(LAYERS)]
            for tid in TRANSFERS
        }
        for tid in TRANSFERS:

            def sink(layer: int, tensor: torch.Tensor, tid: str = tid) -> None:
                scatter_blocks(dst[tid][layer], ids, tensor, LAYOUT)

            agent.expect(tid, num_layers=LAYERS, sink=sink, deadline_s=60.0)
        agent.expect("doomed", num_layers=2, deadline_s=60.0)
        failed = _poll(agent, {*TRANSFERS, "doomed"}, "finished_recving")
        exact = {}
        for seed, tid in enumerate(TRANSFERS):
            want = [gather_blocks(t, torch.tensor(SRC_IDS), LAYOUT) for t in _cache(seed)]
            got = [gather_blocks(t.cpu().view(torch.int16), torch.tensor(DST_IDS), LAYOUT) for t in dst[tid]]
            exact[tid] = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        conn.send("done")
        return {"exact": exact, "failed": failed}


def test_agent_over_nccl_bit_exact_with_abort(spawn: Any) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_agent_sender, 0, left)
    spawn(_agent_receiver, 1, right)
    results = child_results(spawn.queue, 2)
    assert results["_agent_sender"].keys() <= {"doomed"}
    receiver = results["_agent_receiver"]
    assert receiver["exact"] == {tid: True for tid in TRANSFERS}
    assert set(receiver["failed"]) == {"doomed"}
