"""The connector core end to end in one process: two engines' hooks driven by a harness, real paged
KV tensors, fake transfer agents (same interface as kvwire.transfer.TransferAgent)."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.config import EngineInfo
from kvwire.connector.scheduler import KvwireSchedulerConnector
from kvwire.connector.worker import KvwireWorkerConnector
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from support.connector_fakes import (
    BLOCK,
    NUM_BLOCKS,
    NUM_LAYERS,
    FakeFabric,
    FakeRequest,
    Side,
    chunk,
    make_pd,
    push_requests,
)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()






def assert_blocks_equal(p: Side, p_ids: list[int], d: Side, d_ids: list[int]) -> None:
    for layer in range(NUM_LAYERS):
        assert torch.equal(p.caches[layer][:, p_ids], d.caches[layer][:, d_ids]), f"layer {layer} differs"


def test_push_chunked_prefill_moves_every_layer_and_the_first_token(fabric: FakeFabric, registry) -> None:
    p, d = make_pd(fabric, registry)
    preq, dreq = push_requests(p, d, prompt_len=3 * BLOCK + 5)
    p_ids, d_ids = [3, 7, 1, 9], [10, 2, 5, 6]

    assert p.sched.get_num_new_matched_tokens(preq, 0) == (0, False)
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (3 * BLOCK + 5, True)
    d.sched.update_state_after_alloc(dreq, d_ids, 3 * BLOCK + 5)
    d.step()  # D now expects the transfer

    out = p.step(chunk(preq, p_ids[:2], computed=0, scheduled=2 * BLOCK))  # first chunk: nothing sent
    assert not p.agent.sends and not out.finished_sending
    p.step(chunk(preq, p_ids, computed=2 * BLOCK, scheduled=BLOCK + 5))  # completes the prompt
    assert "t1" in p.agent.sends  # every layer handed over, the trailer still missing

    preq.output_token_ids = [42]
    assert p.sched.request_finished(preq, p_ids) == (True, None)  # blocks held until acknowledged
    assert p.metrics.blocks_awaiting_send._value.get() == 4
    p_out = p.until(lambda o: bool(o.finished_sending))
    assert p_out.finished_sending == {preq.request_id}
    assert p.metrics.blocks_awaiting_send._value.get() == 0
    assert p.sched.num_tracked_requests == 0
    for phase in ("p_prefill", "transfer"):
        assert registry.get_sample_value("kvwire_pd_handover_seconds_count", {"phase": phase}) == 1, phase

    d_out = d.until(lambda o: bool(o.finished_recving))
    assert d_out.finished_recving == {dreq.request_id} and not d_out.invalid_block_ids
    assert d.sched.take_first_token(dreq.request_id) == 42
    assert d.sched.take_first_token(dreq.request_id) is None  # handed over once
    assert_blocks_equal(p, p_ids, d, d_ids)
    # Preempted later on D: recomputed locally, never loaded twice.
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (0, False)
    assert d.sched.request_finished(dreq, d_ids) == (False, None)
    assert d.sched.num_tracked_requests == 0


@pytest.mark.parametrize("prompt_len", [1, BLOCK - 1, BLOCK, BLOCK + 1])
def test_push_arrivals_before_d_allocates_are_kept(fabric: FakeFabric, registry, prompt_len: int) -> None:
    p, d = make_pd(fabric, registry)
    preq, dreq = push_requests(p, d, prompt_len)
    num_blocks = math.ceil(prompt_len / BLOCK)
    p_ids, d_ids = list(range(5, 5 + num_blocks)), list(range(num_blocks))
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, p_ids, computed=0, scheduled=prompt_len))
    preq.output_token_ids = [7]
    p.sched.request_finished(preq, p_ids)
    out = p.step()  # trailer goes out: everything is buffered on D's side, P's send is acknowledged
    assert out.finished_sending == {preq.request_id}
    assert p.sched.num_tracked_requests == 0
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (prompt_len, True)
    d.sched.update_state_after_alloc(dreq, d_ids, prompt_len)
    d.until(lambda o: dreq.request_id in o.finished_recving)
    assert d.sched.take_first_token(dreq.request_id) == 7
    assert_blocks_equal(p, p_ids, d, d_ids)


def test_without_first_token_d_loads_prompt_minus_one(fabric: FakeFabric, registry) -> None:
    p, d = make_pd(fabric, registry, use_first_token=False)
    preq, dreq = push_requests(p, d, prompt_len=4 * BLOCK + 1)
    p_ids, d_ids = [1, 2, 3, 4, 5], [9, 8, 7, 6]  # D allocates for 4*BLOCK tokens only
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (4 * BLOCK, True)
    d.sched.update_state_after_alloc(dreq, d_ids, 4 * BLOCK)
    d.step()
    p.sched.get_num_new_matched_tokens(preq, 0)
    fabric.paused = True  # the network is slow: layers still in flight when the request finishes
    p.step(chunk(preq, p_ids, computed=0, scheduled=4 * BLOCK + 1))
    assert p.sched.request_finished(preq, p_ids) == (True, None)  # no trailer expected
    fabric.flush()
    d.until(lambda o: dreq.request_id in o.finished_recving)
    assert d.sched.take_first_token(dreq.request_id) is None
    assert_blocks_equal(p, p_ids[:4], d, d_ids)
    p.until(lambda o: preq.request_id in o.finished_sending)


def test_single_token_prompt_without_first_token_needs_no_transfer(fabric: FakeFabric, registry) -> None:
    p, d = make_pd(fabric, registry, use_first_token=False)
    _, dreq = push_requests(p, d, prompt_len=1)
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (0, False)
    d.step()
    assert d.agent.aborted and d.agent.aborted[0][0] == "t1"  # P is told at once
    assert d.sched.request_finished(dreq, [0]) == (False, None)


def test_pull_lease_params_then_d_pulls(fabric: FakeFabric, registry) -> None:
    p, d = make_pd(fabric, registry)
    prompt = list(range(2 * BLOCK + 3))
    p_params = KVTransferParams(transfer_id="t9", mode=TransferMode.PULL, role=Role.PREFILL, deadline_s=5)
    preq = FakeRequest("p9", prompt, p_params.to_dict())
    p_ids, d_ids = [4, 0, 2], [1, 3, 5]
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, p_ids, computed=0, scheduled=len(prompt)))
    assert p.agent.sends["t9"].peer is None  # held under the lease
    preq.output_token_ids = [11]
    delay, returned = p.sched.request_finished(preq, p_ids)
    assert delay is True and returned is not None
    d_params = KVTransferParams.from_dict(returned)
    assert d_params.role is Role.DECODE and d_params.mode is TransferMode.PULL
    assert d_params.peer_endpoints == [p.agent.endpoint]
    assert d_params.first_token_id == 11 and d_params.num_prompt_tokens == len(prompt)

    dreq = FakeRequest("d9", prompt, returned)
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (len(prompt), True)
    d.sched.update_state_after_alloc(dreq, d_ids, len(prompt))
    d.until(lambda o: dreq.request_id in o.finished_recving)
    assert d.sched.take_first_token(dreq.request_id) == 11
    assert_blocks_equal(p, p_ids, d, d_ids)
    p.until(lambda o: preq.request_id in o.finished_sending)
    assert p.sched.num_tracked_requests == 0


def test_pull_lease_expires_and_frees_p(fabric: FakeFabric, registry) -> None:
    p, _ = make_pd(fabric, registry, lease_s=0.05)
    params = KVTransferParams(transfer_id="t3", mode=TransferMode.PULL, role=Role.PREFILL)
    preq = FakeRequest("p3", [1, 2, 3], params.to_dict(), output_token_ids=[5])
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, [0], computed=0, scheduled=3))
    assert p.sched.request_finished(preq, [0])[0] is True
    p.until(lambda o: preq.request_id in o.finished_sending)
    assert p.sched.num_tracked_requests == 0
    assert p.metrics.transfers_failed.labels(side="send", reason="deadline")._value.get() == 1


def test_pull_prompt_length_mismatch_recomputes(fabric: FakeFabric, registry) -> None:
    _, d = make_pd(fabric, registry)
    params = KVTransferParams(transfer_id="t4", mode=TransferMode.PULL, role=Role.DECODE,
                              peer_endpoints=["fake://p"], first_token_id=3, num_prompt_tokens=9)
    dreq = FakeRequest("d4", [1, 2, 3], params.to_dict())
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (0, False)


def test_d_prefix_cache_hit_keeps_its_own_blocks(fabric: FakeFabric, registry) -> None:
    p, d = make_pd(fabric, registry)
    preq, dreq = push_requests(p, d, prompt_len=2 * BLOCK + 2)
    p_ids, d_ids = [1, 2, 3], [7, 8, 9]
    for cache in d.caches:
        cache[:, 7] = 5.0  # D's cached (shared) first block: must stay untouched
    assert d.sched.get_num_new_matched_tokens(dreq, BLOCK) == (BLOCK + 2, True)
    d.sched.update_state_after_alloc(dreq, d_ids, BLOCK + 2)
    d.step()
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, p_ids, computed=0, scheduled=2 * BLOCK + 2))
    preq.output_token_ids = [9]
    p.sched.request_finished(preq, p_ids)
    p.step()
    d.until(lambda o: dreq.request_id in o.finished_recving)
    assert_blocks_equal(p, p_ids[1:], d, d_ids[1:])
    assert all(bool((c[:, 7] == 5.0).all()) for c in d.caches)


@pytest.mark.parametrize("layout", ["block_first", "mla"])
def test_other_paged_layouts(fabric: FakeFabric, registry, layout: str) -> None:
    from kvwire.transfer.enums import KVLayout

    kv_layout = KVLayout(layout)
    shape = (NUM_BLOCKS, 2, BLOCK, 2, 4) if kv_layout is KVLayout.BLOCK_FIRST else (NUM_BLOCKS, BLOCK, 12)
    p, d = make_pd(fabric, registry, use_first_token=False)
    for side, fill in ((p, torch.randn), (d, torch.zeros)):
        info = EngineInfo(block_size=BLOCK, kv_layout=kv_layout)
        side.sched = KvwireSchedulerConnector(side.config, info, [side.agent.endpoint], metrics=side.metrics)
        side.worker = KvwireWorkerConnector(side.config, info, side.agent, metrics=side.metrics)
        side.caches = [fill(*shape) for _ in range(NUM_LAYERS)]
        side.worker.register_kv_caches(side.caches)
    preq, dreq = push_requests(p, d, prompt_len=2 * BLOCK + 3)  # D loads 2*BLOCK+2 tokens: 3 blocks
    d.sched.get_num_new_matched_tokens(dreq, 0)
    d.sched.update_state_after_alloc(dreq, [9, 3, 4], 2 * BLOCK + 2)
    d.step()
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, [0, 5, 7], computed=0, scheduled=2 * BLOCK + 3))
    d.until(lambda o: dreq.request_id in o.finished_recving)
    for layer in range(NUM_LAYERS):
        assert torch.equal(p.caches[layer][[0, 5, 7]], d.caches[layer][[9, 3, 4]])


def test_registering_caches_runs_gather_and_scatter_once_without_changing_them(
    fabric: FakeFabric, registry: CollectorRegistry
) -> None:
    # the kernels are loaded at registration (see KvwireWorkerConnector._preload_kernels); the caches
    # must come out bit for bit as they went in, every layer and dtype
    side = Side(fabric, "p", Role.PREFILL, registry)
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK, 2, 4), torch.randn(2, NUM_BLOCKS, BLOCK, 2, 4).half()]
    before = [c.clone() for c in caches]
    side.worker.register_kv_caches(caches)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def test_p_promises_the_transfer_at_admission(fabric: FakeFabric, registry) -> None:
    """P's agent is told at once (HTTP admission) that it will send the transfer, so D's lease is
    renewed while P's prefill waits in its queue (decision 051)."""
    p, d = make_pd(fabric, registry)
    preq, _ = push_requests(p, d, prompt_len=BLOCK, tid="t7")
    p.sched.check_request_params(preq.kv_transfer_params)
    assert not p.agent.promises  # handed to the worker with the next step's metadata
    p.step()
    assert p.agent.promises == ["t7"]
    p.step()
    assert p.agent.promises == ["t7"]  # once


def test_p_promises_at_admission_when_its_worker_is_in_process(fabric: FakeFabric, registry) -> None:
    """Built-in server, TP 1 (decision 123): the promise is made at admission, before any engine step;
    the same promise with the next step's metadata changes nothing."""
    p, d = make_pd(fabric, registry)
    p.sched.promise_now = p.worker.promise_now
    preq, _ = push_requests(p, d, prompt_len=BLOCK, tid="t8")
    p.sched.check_request_params(preq.kv_transfer_params)
    assert p.agent.promises == ["t8"]
    p.step()
    assert set(p.agent.promises) == {"t8"}
