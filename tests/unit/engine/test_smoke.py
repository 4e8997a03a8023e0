"""First vertical slice: the public API end to end on the tiny preset."""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time

import pytest
import torch

import kvwire
from kvwire.bench import engine as bench_engine
from kvwire.engine import EngineConfig, LLMEngine, SamplingParams
from kvwire.engine.models import presets


def test_llm_generate_tiny_returns_tokens_and_text() -> None:
    llm = kvwire.LLM(model="tiny", device="cpu", dtype="float32")
    outs = llm.generate(["Hello world", [256, 72, 105]], kvwire.SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)


def test_engine_streams_incremental_text() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=64))
    engine.add_request("r1", engine.tokenizer.encode("abc"), SamplingParams(max_tokens=5, ignore_eos=True))
    new_ids: list[int] = []
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            new_ids += out.new_token_ids
            text += out.new_text
            last = out
    assert last.finished and new_ids == last.token_ids and text == last.text
    assert engine.stats().kv_blocks_in_use == 0


def test_bfloat16_and_device_initialised_presets_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # The llama3-8b-random path (weights initialised on the device, in the target dtype) on small shapes.
    small = dataclasses.replace(presets.PRESETS["tiny"], init_on_cpu=False)
    monkeypatch.setitem(presets.PRESETS, "tiny-on-device", small)
    llm = kvwire.LLM(model="tiny-on-device", dtype="bfloat16", num_kv_blocks=32)
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    [out] = llm.generate([[256, 65, 66]], kvwire.SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out.token_ids) == 6 and all(0 <= t < 264 for t in out.token_ids)


def test_llama3_8b_preset_has_llama3_shapes() -> None:
    cfg = presets.PRESETS["llama3-8b-random"].config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        4096,
        32,
        32,
        8,
        128,
    )
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"


def test_bench_engine_runs_on_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    args = parser.parse_args(
        ["--prompt-len", "40", "--decode-batch-sizes", "1,3", "--decode-steps", "2", "--repeats", "1",
         "--num-requests", "2", "--output-len", "3", "--json"]
    )  # fmt: skip
    assert bench_engine.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [d["batch"] for d in result["decode"]] == [1, 3]
    assert result["prefill"]["prompt_len"] == 40 and result["prefill"]["ratio"] > 0


def test_add_and_abort_from_another_thread_while_stepping() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=128))
    prompt = engine.tokenizer.encode("threads")

    def client() -> None:
        for i in range(20):
            engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
            if i % 2:
                engine.abort_request(f"t{i}")

    thread = threading.Thread(target=client)
    thread.start()
    finished: dict[str, str | None] = {}
    deadline = time.monotonic() + 60
    while (thread.is_alive() or engine.has_unfinished_requests()) and time.monotonic() < deadline:
        finished.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    thread.join(timeout=5)
    assert len(finished) == 20
    assert all(finished[f"t{i}"] == ("abort" if i % 2 else "length") for i in range(20))
    assert engine.stats().kv_blocks_in_use == 0
