"""Failures and aborts at every phase: blocks are released on both sides, the D policy applies."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
from kvwire.connector.scheduler import KvwireSchedulerConnector
from kvwire.errors import ConfigError, TransferError
from kvwire.protocol.kv_params import KVTransferParams, Role
from support.connector_fakes import BLOCK, NUM_LAYERS, FakeRequest, chunk, make_pd, push_requests


@pytest.fixture
def fabric():  # type: ignore[no-untyped-def]
    from support.connector_fakes import FakeFabric

    return FakeFabric()


def start_d(d, dreq, d_ids, n):  # type: ignore[no-untyped-def]
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (n, True)
    d.sched.update_state_after_alloc(dreq, d_ids, n)
    d.step()


def test_d_deadline_recompute_reports_invalid_blocks(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    _, dreq = push_requests(p, d, prompt_len=BLOCK + 1, deadline_s=0.05)
    start_d(d, dreq, [3, 4], BLOCK + 1)
    out = d.until(lambda o: dreq.request_id in o.finished_recving)
    assert {3, 4} <= out.invalid_block_ids
    assert d.sched.take_first_token(dreq.request_id) is None
    assert d.metrics.load_failures.labels(policy="recompute")._value.get() == 1
    assert d.metrics.transfers_failed.labels(side="recv", reason="deadline")._value.get() == 1
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (0, False)  # never loads again
    assert d.sched.request_finished(dreq, [3, 4]) == (False, None)
    assert d.sched.num_tracked_requests == 0


def test_d_policy_fail_gives_a_clear_error(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry(), kv_load_failure_policy=LoadFailurePolicy.FAIL)
    _, dreq = push_requests(p, d, prompt_len=5, deadline_s=0.05)
    start_d(d, dreq, [0], 5)
    out = d.until(lambda o: bool(o.failed))
    assert "remote KV load failed" in out.failed[dreq.request_id]
    assert "deadline" in out.failed[dreq.request_id]
    assert not out.finished_recving
    assert d.metrics.load_failures.labels(policy="fail")._value.get() == 1


def test_p_killed_mid_transfer_d_recomputes(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    preq, dreq = push_requests(p, d, prompt_len=2 * BLOCK)
    start_d(d, dreq, [0, 1], 2 * BLOCK)
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, [5, 6], computed=0, scheduled=2 * BLOCK))  # layers delivered, trailer never
    fabric.kill(p.agent.endpoint)
    out = d.until(lambda o: dreq.request_id in o.finished_recving)
    assert {0, 1} <= out.invalid_block_ids
    assert d.metrics.transfers_failed.labels(side="recv", reason="peer_lost")._value.get() == 1


def test_d_killed_p_frees_blocks(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    preq, _ = push_requests(p, d, prompt_len=BLOCK)
    p.sched.get_num_new_matched_tokens(preq, 0)
    fabric.paused = True  # layers in flight
    p.step(chunk(preq, [2], computed=0, scheduled=BLOCK))
    preq.output_token_ids = [1]
    assert p.sched.request_finished(preq, [2]) == (True, None)
    fabric.kill(d.agent.endpoint)
    out = p.until(lambda o: bool(o.finished_sending))
    assert out.finished_sending == {preq.request_id}  # the engine frees the blocks now
    assert p.sched.num_tracked_requests == 0
    assert p.metrics.blocks_awaiting_send._value.get() == 0


def test_d_abort_mid_receive_holds_blocks_until_cancelled(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    preq, dreq = push_requests(p, d, prompt_len=2 * BLOCK)
    start_d(d, dreq, [0, 1], 2 * BLOCK)
    assert d.sched.request_finished(dreq, [0, 1]) == (True, None)
    out = d.step()
    assert out.finished_sending == {dreq.request_id}  # cancelled: blocks may be reused now
    assert ("t1", "request ended while loading remote KV") in d.agent.aborted
    # P learns (peer_aborted) and frees; late data never lands in D's (reused) blocks.
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, [5, 6], computed=0, scheduled=2 * BLOCK))
    preq.output_token_ids = [3]
    p.sched.request_finished(preq, [5, 6])
    p.until(lambda o: preq.request_id in o.finished_sending)
    assert all(torch.count_nonzero(c[:, [0, 1]]) == 0 for c in d.caches)
    assert d.sched.num_tracked_requests == 0 and p.sched.num_tracked_requests == 0


def test_d_abort_before_allocation_frees_at_once(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    _, dreq = push_requests(p, d, prompt_len=3)
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (3, True)
    assert d.sched.request_finished(dreq, []) == (False, None)
    d.step()
    assert d.agent.aborted[0][0] == "t1"
    _, dreq2 = push_requests(p, d, prompt_len=3, tid="t2")
    d.sched.get_num_new_matched_tokens(dreq2, 0)
    d.sched.update_state_after_alloc(dreq2, [4], 3)
    assert d.sched.request_finished(dreq2, [4]) == (False, None)  # RecvSpec never went out
    d.step()
    assert "t2" not in d.agent.recvs


def test_d_preempted_while_loading_recomputes(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    _, dreq = push_requests(p, d, prompt_len=3)
    start_d(d, dreq, [4], 3)
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (0, False)
    d.step()
    assert d.agent.aborted[0][0] == "t1"
    assert d.sched.request_finished(dreq, [6]) == (False, None)


def test_p_abort_during_chunked_prefill_sends_nothing(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    preq, _ = push_requests(p, d, prompt_len=3 * BLOCK)
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, [0], computed=0, scheduled=BLOCK))
    assert p.sched.request_finished(preq, [0]) == (False, None)
    p.step()
    assert not p.agent.sends and p.sched.num_tracked_requests == 0


def test_p_abort_after_prompt_without_token_sends_empty_trailer(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    preq, dreq = push_requests(p, d, prompt_len=BLOCK)
    start_d(d, dreq, [1], BLOCK)
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.step(chunk(preq, [0], computed=0, scheduled=BLOCK))
    assert p.sched.request_finished(preq, [0]) == (True, None)  # aborted before sampling
    p.until(lambda o: preq.request_id in o.finished_sending)
    d.until(lambda o: dreq.request_id in o.finished_recving)
    assert d.sched.take_first_token(dreq.request_id) is None  # D recomputes the last prompt token


def test_missing_layer_saves_fail_the_send_at_once(fabric) -> None:  # type: ignore[no-untyped-def]
    p, d = make_pd(fabric, CollectorRegistry())
    preq, _ = push_requests(p, d, prompt_len=2)
    p.sched.get_num_new_matched_tokens(preq, 0)
    from kvwire.connector.base import StepInfo

    p.worker.bind_connector_metadata(p.sched.build_connector_meta(StepInfo((chunk(preq, [0], 0, 2),))))
    p.worker.save_kv_layer(0, p.caches[0])  # the host forgot layers 1..N-1
    p.worker.wait_for_save()
    assert p.agent.aborted and "1 of 3 layers" in p.agent.aborted[0][1]
    assert NUM_LAYERS == 3


def test_params_for_the_wrong_role_run_locally(fabric) -> None:  # type: ignore[no-untyped-def]
    p, _ = make_pd(fabric, CollectorRegistry())
    params = KVTransferParams(transfer_id="x", role=Role.DECODE, peer_endpoints=["fake://d"])
    req = FakeRequest("r", [1, 2], params.to_dict())
    assert p.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    bad = FakeRequest("r2", [1, 2], {"transfer_id": ""})
    assert p.sched.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert p.sched.num_tracked_requests == 0


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        ConnectorConfig(deadline_s=0)
    with pytest.raises(ConfigError):
        ConnectorConfig(role="prefill")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        EngineInfo(block_size=0)
    sched = KvwireSchedulerConnector(ConnectorConfig(role=Role.BOTH), EngineInfo(block_size=4), [])
    assert sched.get_num_new_matched_tokens(FakeRequest("a", [1]), 0) == (0, False)


def test_check_request_params_gives_clear_errors(fabric) -> None:  # type: ignore[no-untyped-def]
    from kvwire.errors import InvalidRequestError

    p, d = make_pd(fabric, CollectorRegistry())
    good = KVTransferParams(transfer_id="x", role=Role.PREFILL, peer_endpoints=["fake://d"])
    assert p.sched.check_request_params(good.to_dict()).transfer_id == "x"
    with pytest.raises(InvalidRequestError, match="not served by this decode instance"):
        d.sched.check_request_params(good.to_dict())
    with pytest.raises(InvalidRequestError, match="peer_endpoints"):
        p.sched.check_request_params({"transfer_id": "y", "role": "prefill"})
    with pytest.raises(InvalidRequestError):
        p.sched.check_request_params({"role": "prefill"})


def test_reason_labels_are_bounded() -> None:
    from kvwire.connector.state import reason_label

    assert reason_label("deadline: 0/32 layers acknowledged") == "deadline"
    assert reason_label("peer_lost: NCCL call blocked") == "peer_lost"
    assert reason_label("peer_aborted: request ended") == "peer_aborted"
    assert reason_label("request ended while loading remote KV") == "other"  # no kind: no guessing
    assert reason_label("Connection timed out somewhere") == "other"
    assert reason_label("aborted: request preempted while loading") == "aborted"


LATE = "deadline: offer not expected within 30 s of its arrival (max_unsolicited_wait_s)"


@pytest.mark.parametrize("policy", [LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL])
def test_an_expect_after_the_offer_was_dropped_applies_the_load_policy_at_once(
    fabric, policy: LoadFailurePolicy,  # type: ignore[no-untyped-def]
) -> None:
    """The agent dropped P's Offer before D's engine took the request (decision 159) and raises at
    ``expect``: the receive fails in that step, under the policy, named by its reason."""
    p, d = make_pd(fabric, CollectorRegistry(), kv_load_failure_policy=policy)
    _, dreq = push_requests(p, d, prompt_len=BLOCK + 1)

    def late(transfer_id: str, **kwargs: object) -> None:
        raise TransferError(LATE, transfer_id)

    d.agent.expect = late  # type: ignore[method-assign,assignment]
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (BLOCK + 1, True)
    d.sched.update_state_after_alloc(dreq, [3, 4], BLOCK + 1)
    out = d.step()  # the step that expects reports the failure: no lease, no Renew waited for
    assert (dreq.request_id in out.finished_recving) is (policy is LoadFailurePolicy.RECOMPUTE)
    assert d.metrics.transfers_failed.labels(side="recv", reason="deadline")._value.get() == 1
    assert d.metrics.load_failures.labels(policy=policy.value)._value.get() == 1
    if policy is LoadFailurePolicy.RECOMPUTE:
        assert {3, 4} <= out.invalid_block_ids
    else:
        assert "max_unsolicited_wait_s" in out.failed[dreq.request_id]
