"""The engine calls the KV-connector hooks in vLLM V1's order, and parks requests whose KV is remote."""

from __future__ import annotations

import pytest

from kvwire.connector.base import ConnectorOutput
from kvwire.engine import KVLoadFailurePolicy, LLMEngine
from support.engine_factories import generate, greedy, make_engine, random_prompts, run_all
from support.engine_fake_connectors import (
    Calls,
    DecodeScheduler,
    DecodeWorker,
    RecordingScheduler,
    RecordingWorker,
    Wire,
    prefill,
)

PROMPTS = random_prompts(3, 20, 45, seed=3)
NUM_LAYERS = 4  # the tiny preset


def recording_engine(**overrides: object) -> tuple[LLMEngine, RecordingScheduler, RecordingWorker, Calls]:
    calls = Calls()
    sched, worker = RecordingScheduler(calls), RecordingWorker(calls)
    engine = make_engine(scheduler_connector=sched, worker_connector=worker, **overrides)
    return engine, sched, worker, calls


def last(calls: Calls, name: str) -> tuple[object, ...]:
    return next(c for c in reversed(calls) if c[0] == name)


def test_one_step_calls_hooks_in_order_and_saves_every_layer_before_request_finished() -> None:
    engine, sched, _, calls = recording_engine()
    sched.delay_free.add("p")
    engine.add_request("p", PROMPTS[0], greedy(1))  # a prefill instance: max_tokens=1
    outputs = engine.step()
    layer_calls = [
        ("wait_for_layer_load", i) if j == 0 else ("save_kv_layer", i)
        for i in range(NUM_LAYERS)
        for j in range(2)
    ]
    expected = [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "start_load_kv",
        *(c[0] for c in layer_calls),
        "wait_for_save",
        "get_finished",
        "request_finished",
        "update_connector_output",
    ]
    assert calls.names() == expected
    assert [c for c in calls if c[0] in ("wait_for_layer_load", "save_kv_layer")] == layer_calls
    step = calls[2][1]
    assert [(c.request_id, c.num_computed_tokens, c.num_scheduled_tokens) for c in step.scheduled] == [
        ("p", 0, len(PROMPTS[0]))
    ]
    [out] = outputs
    assert out.finished and out.kv_transfer_params == {"transfer_id": "p", "first_token_id": out.token_ids}
    assert calls[-2][3] == out.token_ids  # the connector sees the sampled token in request_finished


def test_delayed_free_holds_blocks_until_finished_sending() -> None:
    engine, sched, worker, calls = recording_engine()
    sched.delay_free.add("p")
    engine.add_request("p", PROMPTS[0], greedy(1))
    engine.step()
    held = engine.stats().kv_blocks_in_use
    assert held == -(-len(PROMPTS[0]) // 16) and engine.stats().num_delayed_free_requests == 1
    assert engine.has_unfinished_requests()  # the send must still be polled
    engine.step()
    assert last(calls, "get_finished") == ("get_finished", frozenset({"p"}))  # told to the worker once
    worker.outputs.append(ConnectorOutput(finished_sending=frozenset({"p"})))
    engine.step()
    assert engine.stats().kv_blocks_in_use == 0 and not engine.has_unfinished_requests()


def test_finished_sending_before_request_finished_still_frees() -> None:
    engine, sched, worker, _ = recording_engine()
    sched.delay_free.add("p")
    worker.outputs.append(ConnectorOutput(finished_sending=frozenset({"p"})))  # same step as the prefill
    engine.add_request("p", PROMPTS[0], greedy(1))
    engine.step()
    assert engine.stats().kv_blocks_in_use == 0


def test_waiting_for_remote_kv_does_not_block_others() -> None:
    engine, sched, worker, _ = recording_engine()
    sched.matched["d"] = (len(PROMPTS[0]), True)
    sched.first_tokens["d"] = 42
    engine.add_request("d", PROMPTS[0], greedy(5))
    engine.add_request("other", PROMPTS[1], greedy(5))
    outputs: dict[str, list[int]] = {}
    for _ in range(5):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = engine.stats()
    assert stats.num_waiting_for_remote_kv == 1 and "d" not in outputs
    assert len(outputs["other"]) == 5
    assert stats.kv_blocks_in_use >= -(-len(PROMPTS[0]) // 16)  # d holds its blocks meanwhile
    worker.outputs.append(ConnectorOutput(finished_recving=frozenset({"d"})))
    final = run_all(engine)
    assert final["d"].token_ids[0] == 42 and len(final["d"].token_ids) == 5
    assert final["d"].num_cached_tokens == len(PROMPTS[0])


@pytest.mark.parametrize("policy", [KVLoadFailurePolicy.RECOMPUTE, KVLoadFailurePolicy.FAIL])
def test_failed_remote_load_follows_policy(policy: KVLoadFailurePolicy) -> None:
    engine, sched, worker, calls = recording_engine(kv_load_failure_policy=policy)
    sched.matched["d"] = (len(PROMPTS[0]), True)
    engine.add_request("d", PROMPTS[0], greedy(6))
    engine.step()
    worker.outputs.append(ConnectorOutput(failed={"d": "deadline"}))
    final = run_all(engine)["d"]
    stats = engine.stats()
    assert stats.num_kv_load_failures == 1 and stats.kv_blocks_in_use == 0
    assert calls.names().count("get_num_new_matched_tokens") == 1  # never asked again
    if policy is KVLoadFailurePolicy.RECOMPUTE:
        assert final.finish_reason == "length"
        assert final.token_ids == generate(make_engine(), [PROMPTS[0]], greedy(6))[0]
        assert stats.num_kv_load_recomputes == 1
    else:
        assert final.finish_reason == "error" and final.error and "deadline" in final.error
        assert final.token_ids == []


def test_abort_in_every_state_frees_blocks_and_tells_the_connector() -> None:
    engine, sched, _, calls = recording_engine(max_num_seqs=2)
    sched.matched["remote"] = (len(PROMPTS[0]), True)
    engine.add_request("remote", PROMPTS[0], greedy(50))
    engine.add_request("running", PROMPTS[1], greedy(50))
    engine.add_request("running2", PROMPTS[2], greedy(50))
    engine.add_request("waiting", PROMPTS[2], greedy(50))
    engine.step()
    engine.step()
    stats = engine.stats()
    assert (stats.num_waiting_for_remote_kv, stats.num_running, stats.num_waiting) == (1, 2, 1)
    for request_id in ("remote", "running", "waiting", "running2", "unknown-id"):
        engine.abort_request(request_id)
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"remote", "running", "waiting", "running2"}
    assert all(o.finished and o.finish_reason == "abort" for o in outs.values())
    assert engine.stats().kv_blocks_in_use == 0 and not engine.has_unfinished_requests()
    assert sorted(c[1] for c in calls if c[0] == "request_finished") == sorted(outs)
    # Aborts apply before scheduling: the same step's StepInfo and get_finished carry them.
    assert last(calls, "get_finished") == ("get_finished", frozenset(outs))
    assert last(calls, "build_connector_meta")[1].finished_request_ids == frozenset(outs)


# --- real KV moved P -> D in memory ------------------------------------------------------------------


@pytest.mark.parametrize(("load_async", "use_first_token"), [(True, True), (True, False), (False, False)])
def test_decode_from_transferred_kv_equals_local_generation(load_async: bool, use_first_token: bool) -> None:
    expected = generate(make_engine(), PROMPTS, greedy(8))
    wire = Wire()
    prefill(wire, PROMPTS)
    calls = Calls()
    sched = DecodeScheduler(calls, wire, load_async, use_first_token)
    engine = make_engine(scheduler_connector=sched, worker_connector=DecodeWorker(calls, wire, sched, 16))
    assert generate(engine, PROMPTS, greedy(8)) == expected
    # Only the last prompt token (no first token) or nothing (first token) is computed on D.
    assert engine.stats().num_prompt_tokens == (0 if use_first_token else len(PROMPTS))


@pytest.mark.parametrize("bad", [-1, 264, 10**12])  # the tiny model's vocabulary is [0, 264)
def test_a_first_token_outside_the_vocabulary_is_recomputed_and_loses_nothing(bad: int) -> None:
    """P's first token is peer data (its trailer, or kv_transfer_params in pull mode): one outside the
    vocabulary failed D's next forward, and with it every request in flight. It is dropped: that
    request recomputes its last prompt token and every request answers as a local generation."""
    expected = generate(make_engine(), PROMPTS, greedy(8))
    wire = Wire()
    prefill(wire, PROMPTS)
    assert wire.first_token
    wire.first_token["r1"] = bad  # one request's P misbehaves
    calls = Calls()
    sched = DecodeScheduler(calls, wire, load_async=True, use_first_token=True)
    engine = make_engine(scheduler_connector=sched, worker_connector=DecodeWorker(calls, wire, sched, 16))
    assert generate(engine, PROMPTS, greedy(8)) == expected
    assert engine.stats().num_prompt_tokens == 1  # r1's last prompt token, recomputed


def test_every_step_respects_the_token_budget_and_puts_decodes_first() -> None:
    engine, _, _, calls = recording_engine(max_num_batched_tokens=24, block_size=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(6))
    final = run_all(engine)
    steps = [c[1] for c in calls if c[0] == "build_connector_meta"]
    assert all(sum(s.num_scheduled_tokens for s in step.scheduled) <= 24 for step in steps)
    assert any(len(step.scheduled) > 1 for step in steps)  # batched
    for step in steps:  # running requests (decodes, unfinished prompts) are served before new ones
        new = [s.num_computed_tokens == 0 for s in step.scheduled]
        assert new == sorted(new)
    assert [final[f"r{i}"].token_ids for i in range(3)] == generate(make_engine(), PROMPTS, greedy(6))


def test_cpu_kv_cache_is_registered_in_shared_memory() -> None:
    """On CPU the engine's paged KV cache lives in one shared region (a peer on this host writes
    transferred KV straight into it: the shared-memory plane's one-copy path)."""
    from kvwire.transfer.memory import region_of

    _, _, worker, _ = recording_engine()
    regions = [region_of(cache) for cache in worker.kv_caches]
    assert len(regions) == NUM_LAYERS and all(r is not None for r in regions)
    assert len({r[0].region_id for r in regions if r is not None}) == 1
