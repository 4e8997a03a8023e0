"""The connector core on real transfer agents (the plane they negotiate on one host: shared memory)
with 8B-shaped KV: 32 layers of bf16 blocks, a 2048-token prompt (8 MiB per layer, 256 MiB per
request), two requests at once. Every block arrives bit-exact in D's (different) block ids; P's
blocks are released after the acknowledgement."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.base import ConnectorOutput, ScheduledChunk, StepInfo
from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.factory import build_connectors
from kvwire.protocol.kv_params import KVTransferParams, Role

BLOCK, LAYERS, NUM_BLOCKS, KV_HEADS, HEAD_DIM = 16, 32, 264, 8, 128
PROMPT = 2048


class Req:
    def __init__(self, rid: str, params: KVTransferParams) -> None:
        self.request_id = rid
        self.prompt_token_ids = list(range(PROMPT))
        self.kv_transfer_params = params.to_dict()
        self.output_token_ids: list[int] = []


def _step(sched, worker, caches: Sequence[torch.Tensor], chunks=()) -> ConnectorOutput:  # type: ignore[no-untyped-def]
    worker.bind_connector_metadata(sched.build_connector_meta(StepInfo(tuple(chunks))))
    for i, cache in enumerate(caches):
        if chunks:
            worker.save_kv_layer(i, cache)
    worker.wait_for_save()
    out = worker.get_finished(set())
    worker.clear_connector_metadata()
    sched.update_connector_output(out)
    return out


def test_8b_shaped_transfers_bit_exact() -> None:
    info = EngineInfo(block_size=BLOCK)
    shape = (2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    p_sched, p_worker = build_connectors(ConnectorConfig(role=Role.PREFILL), info,
                                         registry=CollectorRegistry())
    d_sched, d_worker = build_connectors(ConnectorConfig(role=Role.DECODE), info,
                                         registry=CollectorRegistry())
    gen = torch.Generator().manual_seed(0)
    p_caches = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    d_caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    p_worker.register_kv_caches(p_caches)
    d_worker.register_kv_caches(d_caches)
    n = PROMPT // BLOCK
    p_ids = {"a": list(range(0, n)), "b": list(range(n + 7, n + 7 + n))[::-1]}
    d_ids = {"a": list(range(NUM_BLOCKS - n, NUM_BLOCKS)), "b": [(i * 37) % n for i in range(n)]}
    try:
        p_reqs, d_reqs = {}, {}
        for key in ("a", "b"):
            tid = f"big-{key}"
            p_reqs[key] = Req("p" + key, KVTransferParams(transfer_id=tid, role=Role.PREFILL,
                                                          peer_endpoints=list(d_sched.kv_endpoints)))
            d_reqs[key] = Req("d" + key, KVTransferParams(transfer_id=tid, role=Role.DECODE,
                                                          peer_endpoints=list(p_sched.kv_endpoints)))
            assert d_sched.get_num_new_matched_tokens(d_reqs[key], 0) == (PROMPT, True)
            d_sched.update_state_after_alloc(d_reqs[key], d_ids[key], PROMPT)
            p_sched.get_num_new_matched_tokens(p_reqs[key], 0)
        _step(d_sched, d_worker, d_caches)
        chunks = [ScheduledChunk(p_reqs[k].request_id, tuple(p_ids[k]), 0, PROMPT, PROMPT) for k in "ab"]
        _step(p_sched, p_worker, p_caches, chunks)
        for key in ("a", "b"):
            p_reqs[key].output_token_ids = [7]
            assert p_sched.request_finished(p_reqs[key], p_ids[key]) == (True, None)
        sent: set[str] = set()
        recvd: set[str] = set()
        first: dict[str, int | None] = {}
        deadline = time.monotonic() + 60
        while (len(sent) < 2 or len(recvd) < 2) and time.monotonic() < deadline:
            sent |= _step(p_sched, p_worker, p_caches).finished_sending
            out = _step(d_sched, d_worker, d_caches)
            assert not out.failed and not out.invalid_block_ids
            recvd |= out.finished_recving
            for rid in out.finished_recving:
                first[rid] = d_sched.take_first_token(rid)
            time.sleep(0.01)
        assert sent == {"pa", "pb"} and recvd == {"da", "db"}
        assert first == {"da": 7, "db": 7}
        for key in ("a", "b"):
            for layer in range(LAYERS):
                assert torch.equal(p_caches[layer][:, p_ids[key]], d_caches[layer][:, d_ids[key]])
        assert p_sched.num_tracked_requests == 0
    finally:
        p_worker.close()
        d_worker.close()
