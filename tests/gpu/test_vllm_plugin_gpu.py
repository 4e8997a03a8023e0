"""The vLLM plugin's scheduler and worker halves on two GPUs over the NCCL data plane (no vLLM:
the GPU machines have none). P and D run in two processes, drive the halves the way vLLM 0.32 does
(schedule -> bind -> save every layer -> wait_for_save -> get_finished -> update_connector_output)
and D's blocks must equal P's bit for bit, for a block-contiguous layout and a permuted
(block-major, head-minor) one, in push and pull mode."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from support.nccl_planes import child_results, two_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")]

BLOCK = 16
NUM_BLOCKS = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
PROMPT = list(range(5 * BLOCK + 3))  # 6 blocks on P; D loads prompt - 1 tokens = 6 blocks
P_BLOCKS = [3, 9, 27, 1, 40, 41]
D_BLOCKS = [60, 2, 5, 33, 34, 7]


def _caches(device: str, permuted: bool, fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {}
    for name in LAYERS:
        shape = (NUM_BLOCKS, BLOCK, 8, 256) if permuted else (NUM_BLOCKS, 8, BLOCK, 256)  # physical
        data = torch.randn(shape, generator=gen) if fill else torch.zeros(shape)
        tensor = data.to(torch.bfloat16).to(device)
        out[name] = tensor.permute(0, 2, 1, 3) if permuted else tensor  # logical [B, H, N, C]
    return out


def _instance(role: str, device: str, permuted: bool, fill: bool) -> Any:
    from kvwire.connector.config import EngineInfo
    from kvwire.integrations.vllm_config import VllmTransferView, plugin_config_from_vllm
    from kvwire.integrations.vllm_scheduler_side import Identity, RankEndpoint, SchedulerSide
    from kvwire.integrations.vllm_worker_side import WorkerSide
    from kvwire.transfer.enums import KVLayout

    cfg = plugin_config_from_vllm(
        VllmTransferView(
            kv_role=role,
            kv_buffer_device="cuda",
            kv_connector_extra_config={"deadline_s": 60, "transport": "nccl"},  # this file tests NCCL
        )
    )
    worker = WorkerSide(cfg, EngineInfo(block_size=BLOCK, device=device, kv_layout=KVLayout.MLA))
    caches = _caches(device, permuted, fill)
    worker.register_kv_caches(caches)
    sched = SchedulerSide(cfg, EngineInfo(block_size=BLOCK), Identity(role, "m", "t"))
    sched.set_endpoints([RankEndpoint(0, worker.endpoint, worker.instance_id)])
    return SimpleNamespace(worker=worker, sched=sched, caches=caches, sending=set(), recving=set())


def _output(new: list[Any] | None = None, num_scheduled: dict[str, int] | None = None) -> Any:
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=new or [], scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled or {}, finished_req_ids=set(),
    )


def _step(inst: Any, output: Any, forward: bool) -> None:
    inst.worker.bind(inst.sched.build_connector_meta(output))
    if forward:
        for name in LAYERS:
            inst.worker.save_kv_layer(name)
    inst.worker.wait_for_save()
    sending, recving = inst.worker.get_finished(set())
    invalid = inst.worker.take_invalid_block_ids()
    out = SimpleNamespace(finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid)
    inst.worker.clear()
    inst.sched.update_connector_output(out)
    assert not out.invalid_block_ids, "a load failed"
    inst.sending |= out.finished_sending
    inst.recving |= out.finished_recving


def _idle_until(inst: Any, done: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        _step(inst, _output(), forward=False)
        time.sleep(0.002)


def _params(tid: str, role: str, mode: str, peers: list[str]) -> dict[str, Any]:
    from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode

    return KVTransferParams(
        transfer_id=tid, role=Role(role), mode=TransferMode(mode), peer_endpoints=peers
    ).to_dict()


def _prefill(conn: Connection, arg: tuple[bool, str]) -> bool:
    permuted, mode = arg
    p = _instance("kv_producer", "cuda:0", permuted, fill=True)
    try:
        conn.send(p.worker.endpoint)
        d_endpoint = conn.recv()  # D is expecting (push) / waiting for our params (pull)
        peers = [d_endpoint] if mode == "push" else []
        req = SimpleNamespace(
            request_id="p-1", prompt_token_ids=PROMPT, output_token_ids=[11],
            kv_transfer_params=_params("t-gpu", "prefill", mode, peers),
        )
        p.sched.get_num_new_matched_tokens(req, 0)
        p.sched.update_state_after_alloc(req, P_BLOCKS, 0)
        new = SimpleNamespace(
            req_id="p-1", prompt_token_ids=PROMPT, block_ids=(P_BLOCKS,), num_computed_tokens=0
        )
        _step(p, _output([new], {"p-1": len(PROMPT)}), forward=True)
        delay, returned = p.sched.request_finished(req, P_BLOCKS)
        assert delay
        conn.send(returned)
        _idle_until(p, lambda: "p-1" in p.sending)
        return p.sched.num_outstanding == 0
    finally:
        p.sched.close()
        p.worker.close()


def _decode(conn: Connection, arg: tuple[bool, str]) -> bool:
    permuted, mode = arg
    d = _instance("kv_consumer", "cuda:1", permuted, fill=False)
    try:
        p_endpoint = conn.recv()
        conn.send(d.worker.endpoint)
        returned = conn.recv()  # P's kv_transfer_params (pull) or None (push), once P prefilled
        if mode == "push":
            params = _params("t-gpu", "decode", mode, [p_endpoint])
        else:
            params = dict(returned, role="decode")
        req = SimpleNamespace(request_id="d-1", prompt_token_ids=PROMPT, kv_transfer_params=params)
        assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, True)
        d.sched.update_state_after_alloc(req, D_BLOCKS, len(PROMPT) - 1)
        _idle_until(d, lambda: "d-1" in d.recving)
        want = _caches("cpu", permuted, fill=True)
        return all(
            torch.equal(d.caches[name][D_BLOCKS].cpu(), want[name][P_BLOCKS]) for name in LAYERS
        )
    finally:
        d.sched.close()
        d.worker.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_plugin_halves_over_nccl(spawn: Any, permuted: bool, mode: str) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_prefill, 0, left, (permuted, mode))
    spawn(_decode, 1, right, (permuted, mode))
    results = child_results(spawn.queue, 2)
    assert results["_decode"] is True, "D's blocks differ from P's"
    assert results["_prefill"] is True, "P still holds blocks"
