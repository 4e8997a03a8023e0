"""The static-shape decode path behind CUDA graphs (run eagerly on the CPU) gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvwire.engine import SamplingParams
from kvwire.engine.decode_graphs import DecodeGraphs, _bucket, _buckets
from support.engine_factories import generate, greedy, make_engine, random_prompts
from support.engine_fake_connectors import Calls, RecordingScheduler, RecordingWorker

PROMPTS = random_prompts(5, 3, 60, seed=9)


def test_buckets() -> None:
    assert _buckets(1) == [1] and _buckets(6) == [1, 2, 4, 6] and _buckets(8) == [1, 2, 4, 8]
    assert _bucket([1, 2, 4, 6], 5) == 6


def test_static_decode_path_matches_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = generate(make_engine(), PROMPTS, greedy(10))
    calls: list[int] = []
    original = DecodeGraphs.run

    def counting_run(self: DecodeGraphs, *args: list) -> object:  # type: ignore[type-arg]
        calls.append(len(args[0]))
        return original(self, *args)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    # max_num_seqs 6: batch buckets 1, 2, 4, 6; small blocks so widths vary.
    engine = make_engine(decode_graphs=True, max_num_seqs=6, block_size=8, max_num_batched_tokens=64)
    assert engine.runner.kv_caches[0].shape[1] == engine.blocks.num_blocks + 1  # + the scratch block
    assert generate(engine, PROMPTS, greedy(10)) == expected
    assert len(calls) >= 5 and {3, 5} & set(calls)  # padded batches were used


def test_preemption_and_seeded_sampling_with_the_static_path() -> None:
    hot = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert generate(make_engine(decode_graphs=True), PROMPTS[:2], hot) == generate(
        make_engine(), PROMPTS[:2], hot
    )
    small = make_engine(decode_graphs=True, num_kv_blocks=14, block_size=8, enable_prefix_caching=False)
    assert generate(small, PROMPTS, greedy(10)) == generate(make_engine(), PROMPTS, greedy(10))
    assert small.stats().num_preemptions > 0


def test_not_used_with_a_real_worker_connector() -> None:
    calls = Calls()
    engine = make_engine(
        decode_graphs=True,
        scheduler_connector=RecordingScheduler(calls),
        worker_connector=RecordingWorker(calls),
    )
    assert engine.runner.graphs is None
    assert engine.runner.kv_caches[0].shape[1] == engine.blocks.num_blocks


def test_capture_all_is_a_no_op_without_cuda() -> None:
    engine = make_engine(decode_graphs=True, max_num_seqs=4)
    assert engine.runner.graphs is not None
    engine.runner.graphs.capture_all()
    assert engine.runner.graphs.graphs == {}


def test_padding_rows_only_touch_the_scratch_block() -> None:
    engine = make_engine(decode_graphs=True, max_num_seqs=4, num_kv_blocks=16)
    graphs = engine.runner.graphs
    assert graphs is not None
    generate(engine, PROMPTS[:2], greedy(3))  # some real KV in the cache
    before = [kv[:, :16].clone() for kv in engine.runner.kv_caches]
    graphs._fill(4, graphs.widths[-1], [], [], [], [])  # what capture_all replays: padding only
    with torch.inference_mode():
        graphs._forward(4, graphs.widths[-1])
    assert all(torch.equal(kv[:, :16], b) for kv, b in zip(engine.runner.kv_caches, before, strict=True))
    assert any(kv[:, 16].abs().sum() > 0 for kv in engine.runner.kv_caches)
