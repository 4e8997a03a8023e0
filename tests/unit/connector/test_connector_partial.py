"""Partial transfers in the connector core (fake agents, real paged tensors, every KV layout): P sends
only the blocks after ``skip_blocks``; D writes them after the prefix it holds, never over it; a D
that no longer holds the prefix drops the transfer and prefills locally."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.base import StepInfo
from kvwire.connector.config import EngineInfo
from kvwire.connector.scheduler import KvwireSchedulerConnector
from kvwire.connector.worker import KvwireWorkerConnector
from kvwire.protocol.kv_params import KVTransferParams, Role
from kvwire.transfer.memory import KVLayout
from support.connector_fakes import BLOCK, NUM_BLOCKS, NUM_LAYERS, FakeFabric, FakeRequest, Side, chunk

SHAPES = {
    KVLayout.KV_FIRST: (2, NUM_BLOCKS, BLOCK, 2, 4),
    KVLayout.BLOCK_FIRST: (NUM_BLOCKS, 2, BLOCK, 2, 4),
    KVLayout.MLA: (NUM_BLOCKS, BLOCK, 12),
    KVLayout.BLOCK_HEAD: (NUM_BLOCKS, 2, BLOCK, 8),
}
BLOCK_DIM = {KVLayout.KV_FIRST: 1, KVLayout.BLOCK_FIRST: 0, KVLayout.MLA: 0, KVLayout.BLOCK_HEAD: 0}


def side(fabric: FakeFabric, name: str, role: Role, layout: KVLayout) -> Side:
    s = Side(fabric, name, role, CollectorRegistry())
    info = EngineInfo(block_size=BLOCK, kv_layout=layout)
    s.sched = KvwireSchedulerConnector(s.config, info, [s.agent.endpoint], metrics=s.metrics)
    s.worker = KvwireWorkerConnector(s.config, info, s.agent, metrics=s.metrics)
    fill = torch.randn if role is Role.PREFILL else torch.zeros
    s.caches = [fill(*SHAPES[layout]) for _ in range(NUM_LAYERS)]
    s.worker.register_kv_caches(s.caches)
    return s


def requests(p: Side, d: Side, prompt_len: int, skip: int) -> tuple[FakeRequest, FakeRequest]:
    prompt = list(range(1, prompt_len + 1))
    common = dict(transfer_id="t1", deadline_s=5.0, skip_blocks=skip)
    p_params = KVTransferParams(role=Role.PREFILL, peer_endpoints=[d.agent.endpoint], **common)  # type: ignore[arg-type]
    d_params = KVTransferParams(role=Role.DECODE, peer_endpoints=[p.agent.endpoint], **common)  # type: ignore[arg-type]
    return FakeRequest("p-t1", prompt, p_params.to_dict()), FakeRequest("d-t1", prompt, d_params.to_dict())


def blocks(s: Side, layer: int, ids: list[int], layout: KVLayout) -> torch.Tensor:
    return s.caches[layer].index_select(BLOCK_DIM[layout], torch.tensor(ids))


def partial_value(s: Side, outcome: str, side_label: str) -> float:
    return s.metrics.partial_transfers.labels(side=side_label, outcome=outcome)._value.get()


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("d_local_blocks", [1, 2])  # D holds exactly the skipped prefix, or more
def test_p_sends_only_the_blocks_d_lacks(layout: KVLayout, d_local_blocks: int) -> None:
    fabric = FakeFabric()
    p, d = side(fabric, "p", Role.PREFILL, layout), side(fabric, "d", Role.DECODE, layout)
    preq, dreq = requests(p, d, prompt_len=3 * BLOCK + 2, skip=1)  # 4 blocks, D holds block 0 (or 0-1)
    p_ids, d_ids = [3, 7, 1, 9], [10, 2, 5, 6]
    held = d_ids[:d_local_blocks]
    for cache in d.caches:
        cache.index_fill_(BLOCK_DIM[layout], torch.tensor(held), 5.0)  # D's own prefix: never written
    local = d_local_blocks * BLOCK
    assert d.sched.get_num_new_matched_tokens(dreq, local) == (3 * BLOCK + 2 - local, True)
    d.sched.update_state_after_alloc(dreq, d_ids, 3 * BLOCK + 2 - local)
    d.step()
    assert p.sched.get_num_new_matched_tokens(preq, 0) == (0, False)
    p.step(chunk(preq, p_ids, computed=0, scheduled=3 * BLOCK + 2))
    preq.output_token_ids = [9]
    p.sched.request_finished(preq, p_ids)
    p.step()
    d.until(lambda o: dreq.request_id in o.finished_recving)
    for layer in range(NUM_LAYERS):
        fresh = slice(d_local_blocks, 4)
        assert torch.equal(blocks(p, layer, p_ids[fresh], layout), blocks(d, layer, d_ids[fresh], layout))
        assert bool((blocks(d, layer, held, layout) == 5.0).all())
    sent = p.metrics.send_bytes._value.get()
    per_block = p.caches[0].element_size() * p.caches[0].numel() // NUM_BLOCKS
    assert sent == per_block * 3 * NUM_LAYERS  # blocks 1..3 only, every layer
    assert partial_value(p, "started", "send") == 1 and partial_value(d, "started", "recv") == 1


def test_d_that_lost_the_prefix_drops_the_transfer_and_prefills_locally() -> None:
    fabric = FakeFabric()
    p = side(fabric, "p", Role.PREFILL, KVLayout.KV_FIRST)
    d = side(fabric, "d", Role.DECODE, KVLayout.KV_FIRST)
    _, dreq = requests(p, d, prompt_len=3 * BLOCK + 2, skip=2)
    assert d.sched.get_num_new_matched_tokens(dreq, BLOCK) == (0, False)  # holds 1 of the 2 blocks
    meta = d.sched.build_connector_meta(StepInfo(scheduled=(), finished_request_ids=frozenset()))
    assert [a.transfer_id for a in meta.aborts] == ["t1"] and not meta.recvs  # P is told at once
    assert partial_value(d, "missed", "recv") == 1
    assert d.sched.num_tracked_requests == 1  # a local request now; it ends like any other
    assert d.sched.request_finished(dreq, [])[0] is False
    assert d.sched.num_tracked_requests == 0
