"""First vertical slice: the public API end to end on the tiny preset."""

from __future__ import annotations

import kvwire
from kvwire.engine import EngineConfig, LLMEngine, SamplingParams


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
