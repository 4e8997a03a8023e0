"""Sampler, stop conditions and request validation."""

from __future__ import annotations

import pytest
import torch

from kvwire.engine import SamplingParams
from kvwire.engine.model_runner import Sampler, filtered_probs
from kvwire.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer
from kvwire.errors import InvalidRequestError
from support.engine_factories import generate, greedy, make_engine, random_prompts, run_all

PROMPT = random_prompts(1, 12, 12, seed=5)[0]


def test_sampler_filters() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]] * 200)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 100 + [
        SamplingParams(temperature=1.0, top_p=0.5)
    ] * 100
    tokens = sampler.sample(logits, params, [None] * 200)
    assert set(tokens[:100]) == {1, 2}  # only the two best
    assert set(tokens[100:]) == {1}  # token 1 alone covers half the mass
    assert sampler.sample(logits[:1], [SamplingParams()], [None]) == [1]  # greedy


def test_seeded_sampling_repeats_and_unseeded_differs() -> None:
    engine = make_engine()
    hot = SamplingParams(max_tokens=10, temperature=1.5, seed=7, ignore_eos=True)
    a = generate(engine, [PROMPT], hot)[0]
    b = generate(engine, [PROMPT, PROMPT], hot)  # batched with a twin: same seed, same tokens
    assert b == [a, a]
    unseeded = SamplingParams(max_tokens=10, temperature=1.5, ignore_eos=True)
    assert len({tuple(t) for t in generate(engine, [PROMPT] * 4, unseeded)}) > 1


def test_greedy_is_top_k_one() -> None:
    engine = make_engine()
    assert generate(engine, [PROMPT], greedy(8)) == generate(
        engine, [PROMPT], SamplingParams(max_tokens=8, temperature=0.8, top_k=1, ignore_eos=True)
    )


def test_stop_token_ids_eos_and_ignore_eos() -> None:
    engine = make_engine()
    free_run = generate(engine, [PROMPT], greedy(10))[0]
    stop_at = free_run[4]
    out = generate(
        engine, [PROMPT], SamplingParams(max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True)
    )[0]
    assert out == free_run[: free_run.index(stop_at) + 1]
    engine.tokenizer.eos_token_ids = frozenset({stop_at})  # type: ignore[misc]
    engine.add_request("eos", PROMPT, SamplingParams(max_tokens=10))
    final = run_all(engine)["eos"]
    assert final.finish_reason == "stop" and final.token_ids[-1] == stop_at
    assert generate(engine, [PROMPT], greedy(10))[0] == free_run  # ignore_eos


def test_stop_string_cuts_text() -> None:
    engine = make_engine()
    engine.add_request("free", PROMPT, greedy(12))
    text = run_all(engine)["free"].text
    stop = text[3:5]
    assert stop and text.find(stop) == 3
    engine.add_request("stopped", PROMPT, SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))
    out = run_all(engine)["stopped"]
    assert out.finish_reason == "stop" and out.text == text[:3]


def test_max_model_len_ends_with_length() -> None:
    engine = make_engine(max_model_len=20)
    engine.add_request("r", PROMPT, greedy(100))
    out = run_all(engine)["r"]
    assert out.finish_reason == "length" and len(PROMPT) + len(out.token_ids) == 20


def test_incremental_detokenizer_holds_back_split_utf8() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = list("héllo €".encode())
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(deltas) == "héllo €" and "\ufffd" not in "".join(deltas)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"stop": [""]},
     {"seed": "x"}, {"stop_token_ids": [-1]}],
)  # fmt: skip
def test_bad_sampling_params_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_bad_requests_raise_and_leave_the_engine_serving() -> None:
    engine = make_engine(max_model_len=64, num_kv_blocks=8)
    bad = [
        ("", [1, 2]),
        ("a", []),
        ("b", [1, 100_000]),
        ("c", [1] * 64),  # no room for one output token
        ("d", [True, 2]),
    ]
    for request_id, prompt in bad:
        with pytest.raises(InvalidRequestError):
            engine.add_request(request_id, prompt, greedy(4))  # type: ignore[arg-type]
    engine.add_request("ok", PROMPT, greedy(4))
    with pytest.raises(InvalidRequestError):
        engine.add_request("ok", PROMPT, greedy(4))  # id in use
    assert len(run_all(engine)["ok"].token_ids) == 4
    engine.add_request("ok", PROMPT, greedy(4))  # reusable once finished
    assert len(run_all(engine)["ok"].token_ids) == 4


def test_filtered_probs_match_a_per_row_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8),
    ]
    probs = filtered_probs(logits, params)
    for row, p in enumerate(params):
        scaled = logits[row] / p.temperature
        keep = torch.ones(50, dtype=torch.bool)
        order = scaled.argsort(descending=True)
        if p.top_k:
            keep[order[p.top_k :]] = False
        masked = scaled.masked_fill(~keep, float("-inf"))
        sorted_probs = masked[order].softmax(-1)
        before = sorted_probs.cumsum(-1) - sorted_probs
        keep[order[before >= p.top_p]] = False
        expected = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
        torch.testing.assert_close(probs[row], expected)
    assert (probs[1] > 0).sum() == 5
