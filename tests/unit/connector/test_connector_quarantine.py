"""D keeps the blocks of a failed or aborted receive while the agent reports its transfer unsettled
(a stalled shared-memory sender may still write into them, decision 114): the engine hears of the
outcome (recompute, failure, blocks free) only once the transfer is settled."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvwire.connector.base import ConnectorOutput
from kvwire.connector.config import LoadFailurePolicy
from support.connector_fakes import BLOCK, FakeFabric, make_pd, push_requests


def _start_d(d, dreq, d_ids, n):  # type: ignore[no-untyped-def]
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (n, True)
    d.sched.update_state_after_alloc(dreq, d_ids, n)
    d.step()


def _nothing_for(out: ConnectorOutput, request_id: str) -> bool:
    return (
        request_id not in out.finished_recving
        and request_id not in out.finished_sending
        and request_id not in out.failed
        and not out.invalid_block_ids
    )


@pytest.mark.parametrize("policy", [LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL])
def test_a_failed_receive_is_reported_only_once_its_transfer_is_settled(policy: LoadFailurePolicy) -> None:
    fabric = FakeFabric()
    p, d = make_pd(fabric, CollectorRegistry(), kv_load_failure_policy=policy)
    _, dreq = push_requests(p, d, prompt_len=BLOCK + 1, deadline_s=0.05)
    d.agent.unsettled_transfers = {"t1": 4096}  # a sender stalled mid-layer holds the grant
    _start_d(d, dreq, [3, 4], BLOCK + 1)
    failed = d.metrics.transfers_failed.labels(side="recv", reason="deadline")
    out = d.until(lambda o: failed._value.get() == 1)  # the receive failed at its deadline ...
    assert _nothing_for(out, dreq.request_id)  # ... but the engine keeps the blocks
    assert d.metrics.quarantined_blocks._value.get() == 2 and d.worker.num_quarantined_blocks == 2
    for _ in range(3):
        assert _nothing_for(d.step(), dreq.request_id)
    d.agent.unsettled_transfers = {}  # the sender let go of the grant (or died)
    out = d.step()
    if policy is LoadFailurePolicy.RECOMPUTE:
        assert dreq.request_id in out.finished_recving and {3, 4} <= out.invalid_block_ids
    else:
        assert "deadline" in out.failed[dreq.request_id]
    assert d.metrics.quarantined_blocks._value.get() == 0 and d.worker.num_quarantined_blocks == 0


def test_an_aborted_receive_frees_its_blocks_only_once_settled() -> None:
    """The request ended while loading (the engine holds its blocks until ``finished_sending``)."""
    fabric = FakeFabric()
    p, d = make_pd(fabric, CollectorRegistry())
    _, dreq = push_requests(p, d, prompt_len=2 * BLOCK, deadline_s=30.0)
    _start_d(d, dreq, [5, 6], 2 * BLOCK)
    assert d.sched.request_finished(dreq, [5, 6]) == (True, None)  # delay_free
    d.agent.unsettled_transfers = {"t1": 8192}
    assert _nothing_for(d.step(), dreq.request_id)  # the abort went out, the blocks stay held
    assert ("t1", "request ended while loading remote KV") in d.agent.aborted
    assert d.worker.num_quarantined_blocks == 2
    assert _nothing_for(d.step(), dreq.request_id)
    d.agent.unsettled_transfers = {}
    assert d.step().finished_sending == {dreq.request_id}
    assert d.worker.num_quarantined_blocks == 0


def test_a_settled_failure_is_reported_at_once() -> None:
    """The fast path: nothing unsettled, the outcome goes out in the step that saw the failure."""
    fabric = FakeFabric()
    p, d = make_pd(fabric, CollectorRegistry())
    _, dreq = push_requests(p, d, prompt_len=BLOCK, deadline_s=0.05)
    d.agent.unsettled_transfers = {"another": 1}  # someone else's transfer: not this request's
    _start_d(d, dreq, [2], BLOCK)
    out = d.until(lambda o: dreq.request_id in o.finished_recving)
    assert 2 in out.invalid_block_ids
    assert d.worker.num_quarantined_blocks == 0
