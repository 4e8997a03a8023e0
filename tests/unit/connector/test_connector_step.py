"""The built-in engine's one-call path (decision 131): ``plan_step`` / ``run_step`` /
``report_step`` do what the vLLM-shaped hooks do one by one, on the real connector halves."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.base import Allocation, ScheduledChunk, StepPlan, StepReport, WorkerConnector
from kvwire.connector.metadata import AbortSpec
from kvwire.errors import TransferError
from support.connector_fakes import NUM_LAYERS, FakeFabric, FakeRequest, Side, chunk, make_pd, push_requests


def one_call_step(side: Side, plan: StepPlan, forward_layers: int | None = None) -> StepReport:
    """One engine step the built-in engine's way: plan in, the forward inside ``run_step`` (saving
    ``forward_layers`` layers, all by default when something is scheduled), report out."""
    saved = NUM_LAYERS if forward_layers is None else forward_layers

    def forward(hooks: WorkerConnector | None) -> str:
        if plan.scheduled:  # layer hooks exactly when this step starts a send
            assert hooks is (side.worker if side.worker._sender.saving else None)
        for index in range(saved if hooks is not None else 0):
            hooks.wait_for_layer_load(index)  # type: ignore[union-attr]
            hooks.save_kv_layer(index, side.caches[index])  # type: ignore[union-attr]
        return "sampled"

    metadata = side.sched.plan_step(plan)
    result, output = side.worker.run_step(metadata, plan.finished_request_ids, forward)
    assert result == "sampled"
    return side.sched.report_step(output)


def report_until(side: Side, request_id: str, timeout_s: float = 5.0) -> StepReport:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = one_call_step(side, StepPlan(()))
        if request_id in report.output.finished_recving | report.output.finished_sending:
            return report
        time.sleep(0.005)
    raise AssertionError(f"{request_id} not reported before the deadline")


def plan(*chunks: ScheduledChunk, allocated: Sequence[Allocation] = ()) -> StepPlan:
    return StepPlan(tuple(chunks), allocated=tuple(allocated))


def test_push_with_first_token_through_plan_run_and_report() -> None:
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    preq, dreq = push_requests(p, d, prompt_len=20)
    p_ids, d_ids = [3, 7, 1], [10, 2, 5]
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (20, True)
    one_call_step(d, plan(allocated=[Allocation(dreq, tuple(d_ids), 20)]))  # D expects the transfer
    assert p.sched.get_num_new_matched_tokens(preq, 0) == (0, False)
    one_call_step(p, plan(chunk(preq, p_ids, computed=0, scheduled=20), allocated=[Allocation(preq, (), 0)]))
    # CPU caches: the layers the forward wrote wait for P's next step (decision 141), which hands
    # them over before anything else; the send is announced to the agent then too (decision 147):
    # no Offer while P computes its first token, D's lease renewed by P's promise meanwhile
    assert "t1" not in p.agent.sends and p.agent.promises == ["t1"]
    preq.output_token_ids = [42]
    assert p.sched.request_finished(preq, p_ids) == (True, None)
    assert report_until(p, preq.request_id).output.finished_sending == {preq.request_id}
    report = report_until(d, dreq.request_id)
    assert report.first_tokens == {dreq.request_id: 42}  # P's token, resolved by the scheduler half
    for layer in range(NUM_LAYERS):
        assert torch.equal(p.caches[layer][:, p_ids], d.caches[layer][:, d_ids])
    assert d.sched.request_finished(dreq, d_ids) == (False, None)
    assert d.sched.num_tracked_requests == 0 and p.sched.num_tracked_requests == 0


def test_no_first_token_in_the_report_without_the_trailer() -> None:
    p, d = make_pd(FakeFabric(), CollectorRegistry(), use_first_token=False)
    preq, dreq = push_requests(p, d, prompt_len=17)
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (16, True)  # D recomputes the last token
    one_call_step(d, plan(allocated=[Allocation(dreq, (4, 5), 16)]))
    p.sched.get_num_new_matched_tokens(preq, 0)
    one_call_step(p, plan(chunk(preq, [0, 1, 2], computed=0, scheduled=17)))
    one_call_step(p, StepPlan(()))  # P's next step hands the held KV layers over (decision 141)
    report = report_until(d, dreq.request_id)
    assert report.output.finished_recving == {dreq.request_id} and report.first_tokens == {}


def test_run_step_ends_the_saves_when_the_forward_raises() -> None:
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    preq, _ = push_requests(p, d, prompt_len=9)
    p.sched.get_num_new_matched_tokens(preq, 0)
    metadata = p.sched.plan_step(plan(chunk(preq, [0, 1], computed=0, scheduled=9)))

    def forward(hooks: WorkerConnector | None) -> None:
        assert hooks is p.worker  # a send starts in this step
        hooks.save_kv_layer(0, p.caches[0])
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        p.worker.run_step(metadata, frozenset(), forward)
    # a send that did not get every layer can never complete: aborted at once, not at its deadline
    assert p.agent.aborted == [("t1", f"mismatch: 1 of {NUM_LAYERS} layers saved")]
    preq.output_token_ids = [5]
    p.sched.request_finished(preq, [0, 1])
    assert report_until(p, preq.request_id).output.finished_sending == {preq.request_id}


def test_a_request_without_params_costs_the_connector_nothing() -> None:
    p, _ = make_pd(FakeFabric(), CollectorRegistry())
    local = FakeRequest("local", [1, 2, 3])
    assert p.sched.get_num_new_matched_tokens(local, 0) == (0, False)
    step = plan(chunk(local, [0], 0, 3), allocated=[Allocation(local, (0,), 0)])
    assert p.sched.plan_step(step).is_empty()
    report = one_call_step(p, step)  # its forward gets no layer hooks: nothing to save
    assert report == StepReport(report.output) and not report.output.finished_sending
    assert not p.agent.sends and p.sched.num_tracked_requests == 0


def test_cpu_layers_are_handed_over_at_the_next_step_in_order() -> None:
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    preq, dreq = push_requests(p, d, prompt_len=9)
    d.sched.get_num_new_matched_tokens(dreq, 0)
    one_call_step(d, plan(allocated=[Allocation(dreq, (6, 7), 9)]))
    p.sched.get_num_new_matched_tokens(preq, 0)
    handed: list[int] = []
    send_blocks = p.agent.send_blocks

    def spy(transfer_id: str, layer_index: int, *args: object, **kwargs: object) -> None:
        handed.append(layer_index)
        send_blocks(transfer_id, layer_index, *args, **kwargs)  # type: ignore[arg-type]

    p.agent.send_blocks = spy  # type: ignore[method-assign]
    one_call_step(p, plan(chunk(preq, [0, 1], computed=0, scheduled=9)))
    assert handed == []  # nothing during the forward nor before the step returned
    preq.output_token_ids = [3]
    assert p.sched.request_finished(preq, [0, 1]) == (True, None)  # blocks kept until sent
    report = one_call_step(p, StepPlan(()))  # the layers, then the trailer
    assert handed == list(range(NUM_LAYERS))
    sent = report.output.finished_sending or report_until(p, preq.request_id).output.finished_sending
    assert sent == {preq.request_id}
    assert report_until(d, dreq.request_id).first_tokens == {dreq.request_id: 3}
    for layer in range(NUM_LAYERS):
        assert torch.equal(p.caches[layer][:, [0, 1]], d.caches[layer][:, [6, 7]])


def test_held_layers_of_an_aborted_request_are_not_handed_over() -> None:
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    preq, _ = push_requests(p, d, prompt_len=9)
    p.sched.get_num_new_matched_tokens(preq, 0)
    one_call_step(p, plan(chunk(preq, [0, 1], computed=0, scheduled=9)))
    p.worker._apply_abort(AbortSpec(preq.request_id, "t1", "client went away", False))
    p.agent.send_blocks = None  # type: ignore[assignment,method-assign]  # any call now fails the test
    one_call_step(p, StepPlan(()))
    assert ("t1", "client went away") in p.agent.aborted


def test_the_hook_driven_host_hands_held_layers_over_at_wait_for_save() -> None:
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    preq, _ = push_requests(p, d, prompt_len=9)
    p.sched.get_num_new_matched_tokens(preq, 0)
    metadata = p.sched.plan_step(plan(chunk(preq, [0, 1], computed=0, scheduled=9)))
    p.worker.bind_connector_metadata(metadata)  # vLLM's sequence of hooks
    for index in range(NUM_LAYERS):
        p.worker.save_kv_layer(index, p.caches[index])
    assert "t1" not in p.agent.sends  # held during the forward, its start too (CPU caches)
    p.worker.wait_for_save()  # vLLM has no later point before its output: the forward's end
    assert p.agent.sends["t1"].delivered | set(p.agent.sends["t1"].data) == set(range(NUM_LAYERS))
    p.worker.clear_connector_metadata()


def test_a_held_push_the_agent_refuses_at_the_next_step_is_reported_failed() -> None:
    """The send's start moved to the step boundary (decision 147): a refusal there fails the request's
    send as a refusal at admission did (counted, reported, P frees its blocks), nothing handed over."""
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    preq, _ = push_requests(p, d, prompt_len=9)
    p.sched.get_num_new_matched_tokens(preq, 0)
    one_call_step(p, plan(chunk(preq, [0, 1], computed=0, scheduled=9)))

    def refuse(transfer_id: str, *args: object, **kwargs: object) -> None:
        raise TransferError("too many transfers", transfer_id)

    p.agent.start_send = refuse  # type: ignore[method-assign,assignment]
    p.agent.send_blocks = None  # type: ignore[assignment,method-assign]  # any call now fails the test
    preq.output_token_ids = [3]
    assert p.sched.request_finished(preq, [0, 1]) == (True, None)
    assert one_call_step(p, StepPlan(())).output.finished_sending == {preq.request_id}
    failed = p.worker._metrics.transfers_failed.labels(side="send", reason="other")._value.get()
    assert failed == 1 and p.worker.num_live_transfers == 0
    assert [tid for tid, _ in p.agent.aborted] == ["t1"]  # its promise ends: D is told at once


def test_p_promises_once_whatever_path_the_promise_takes() -> None:
    """Built-in server: the promise made at HTTP admission comes again from the engine's admission
    and twice with the next step's metadata; the agent is asked once (decision 147: the repeats ran
    on the engine thread before P's forward, each waking the agent's control thread)."""
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    p.sched.promise_now = p.worker.promise_now
    preq, _ = push_requests(p, d, prompt_len=9, tid="t3")
    p.sched.check_request_params(preq.kv_transfer_params)
    p.sched.get_num_new_matched_tokens(preq, 0)
    one_call_step(p, plan(chunk(preq, [0, 1], computed=0, scheduled=9)))
    assert p.agent.promises == ["t3"]


def test_a_refused_promise_is_asked_again() -> None:
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    p.sched.promise_now = p.worker.promise_now
    preq, _ = push_requests(p, d, prompt_len=9, tid="t4")
    promise = p.agent.promise

    def refuse_once(transfer_id: str, *args: object, **kwargs: object) -> None:
        p.agent.promise = promise  # type: ignore[method-assign]
        raise TransferError("too many promised transfers", transfer_id)

    p.agent.promise = refuse_once  # type: ignore[method-assign,assignment]
    p.sched.check_request_params(preq.kv_transfer_params)
    assert p.agent.promises == []
    p.sched.get_num_new_matched_tokens(preq, 0)  # the engine's admission promises again
    assert p.agent.promises == ["t4"]


@pytest.mark.parametrize("same_process", [True, False], ids=["withdraw-now", "next-step"])
def test_a_promised_request_the_engine_never_took_ends_its_promise(same_process: bool) -> None:
    """HTTP admission promised D the request's KV, then the engine never took it (refused, shutting
    down, the client gone first): the promise ends as an abort ends it, D is told at once, instead of
    renewing D's lease on a send that cannot come up to its limit. In the same process at once;
    otherwise (the worker on another rank) with the next step's metadata, the promise not sent."""
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    if same_process:
        p.sched.promise_now = p.worker.promise_now
        p.sched.withdraw_now = p.worker.withdraw_now
    preq, _ = push_requests(p, d, prompt_len=9, tid="t5")
    params = p.sched.check_request_params(preq.kv_transfer_params)
    p.sched.withdraw_request_params(params, "not admitted: CancelledError")
    if same_process:
        assert p.agent.promises == ["t5"] and [tid for tid, _ in p.agent.aborted] == ["t5"]
    meta = p.sched.plan_step(StepPlan(()))
    assert meta.promises == () and [a.transfer_id for a in meta.aborts] == ["t5"]
    p.worker.bind_connector_metadata(meta)
    assert "t5" in [tid for tid, _ in p.agent.aborted] and "t5" not in p.agent.promises[1:]
    p.worker.clear_connector_metadata()


@pytest.mark.parametrize("send", ["held", "offered", "acknowledged"])
def test_a_send_withdrawn_after_the_engine_took_its_request_frees_the_blocks(send: str) -> None:
    """The client went away as the engine took the request: the admission is cancelled, so the HTTP
    server aborts the request and withdraws its params (decision 146), but P's prefill had run, and
    its blocks wait for the send (``delay_free``). The withdrawal aborts the send at the agent at
    once and, with the next step's metadata, on this rank; the blocks are then reported free, as
    after any send that ended: whether the send was still held (CPU caches), offered (D answers
    nothing) or already acknowledged, the agent's report of it not yet polled."""
    fabric, registry = FakeFabric(), CollectorRegistry()
    p, d = make_pd(fabric, registry)
    p.sched.promise_now, p.sched.withdraw_now = p.worker.promise_now, p.worker.withdraw_now
    preq, _ = push_requests(p, d, prompt_len=9, tid="t6")
    params = p.sched.check_request_params(preq.kv_transfer_params)
    p.sched.get_num_new_matched_tokens(preq, 0)
    one_call_step(p, plan(chunk(preq, [0, 1], computed=0, scheduled=9)))  # the prefill announces the send
    preq.output_token_ids = [42]
    assert p.sched.request_finished(preq, [0, 1]) == (True, None)  # blocks held for the send
    assert registry.get_sample_value("kvwire_pd_blocks_awaiting_send") == 2  # blocks
    fabric.paused = True  # D takes nothing, acknowledges nothing (yet)
    if send != "held":
        assert not one_call_step(p, StepPlan(())).output.finished_sending  # the layers go (decision 147)
        assert "t6" in p.agent.sends
    if send == "acknowledged":
        fabric.flush()  # D took it all: the agent reports the send done at its next poll
        assert "t6" not in p.agent.sends
    p.sched.withdraw_request_params(params, "not admitted: CancelledError")
    freed = [one_call_step(p, StepPlan(())).output.finished_sending for _ in range(2)]
    assert freed == [{preq.request_id}, frozenset()]
    assert p.sched.num_tracked_requests == 0
    assert registry.get_sample_value("kvwire_pd_blocks_awaiting_send") == 0


def test_a_withdrawal_in_the_step_that_starts_the_send_ends_it() -> None:
    """The withdrawal reaches the worker with the metadata of the very step in which the engine
    prefilled the request it took after all: the send is announced and then aborted (no Offer for a
    request the client left); its blocks are free once the request ends."""
    p, d = make_pd(FakeFabric(), CollectorRegistry())
    p.sched.promise_now, p.sched.withdraw_now = p.worker.promise_now, p.worker.withdraw_now
    preq, _ = push_requests(p, d, prompt_len=9, tid="t7")
    params = p.sched.check_request_params(preq.kv_transfer_params)
    p.sched.get_num_new_matched_tokens(preq, 0)
    p.sched.withdraw_request_params(params, "not admitted: CancelledError")
    report = one_call_step(p, plan(chunk(preq, [0, 1], computed=0, scheduled=9)))
    assert report.output.finished_sending == {preq.request_id}
    preq.output_token_ids = [42]
    assert p.sched.request_finished(preq, [0, 1]) == (False, None)  # freed with the request
    assert not one_call_step(p, StepPlan(())).output.finished_sending
    assert "t7" not in p.agent.sends and p.sched.num_tracked_requests == 0
