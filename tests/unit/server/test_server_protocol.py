"""Request decoding/validation of the OpenAI endpoints (no engine, no HTTP)."""

from __future__ import annotations

import json

import pytest

from kvwire.server.openai_protocol import (
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    BadRequest,
    chat_messages,
    parse_chat,
    parse_completion,
    prompt_token_source,
    stop_strings,
)


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_completion_text_and_defaults() -> None:
    req = parse_completion(body(model="tiny", prompt="hello", max_tokens=5, temperature=0))
    assert prompt_token_source(req) == "hello"
    assert req.max_tokens == 5 and req.temperature == 0.0 and not req.stream
    assert stop_strings(req) == []


@pytest.mark.parametrize("prompt, expected", [
    ([1, 2, 3], [1, 2, 3]),
    ([[4, 5]], [4, 5]),
    (["one prompt"], "one prompt"),
])
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    assert prompt_token_source(parse_completion(body(prompt=prompt))) == expected


def test_stop_accepts_string_or_list() -> None:
    assert stop_strings(parse_completion(body(prompt="x", stop="\n"))) == ["\n"]
    assert stop_strings(parse_completion(body(prompt="x", stop=["a", "b"]))) == ["a", "b"]


@pytest.mark.parametrize("raw, param", [
    (b"", None),
    (b"{not json", None),
    (b"[1, 2]", None),
    (body(), "prompt"),
    (body(prompt=""), "prompt"),
    (body(prompt=[]), "prompt"),
    (body(prompt=[1, -2]), "prompt"),
    (body(prompt=["a", "b"]), "prompt"),
    (body(prompt=[1.5, 2]), "prompt"),
    (body(prompt=7), "prompt"),
    (body(prompt="x", max_tokens=0), "max_tokens"),
    (body(prompt="x", max_tokens=-3), "max_tokens"),
    (body(prompt="x", max_tokens="5"), "max_tokens"),
    (body(prompt="x", max_tokens=2.5), "max_tokens"),
    (body(prompt="x", max_tokens=True), "max_tokens"),
    (body(prompt="x", temperature=-0.1), "temperature"),
    (body(prompt="x", temperature="hot"), "temperature"),
    (body(prompt="x", top_p=0), "top_p"),
    (body(prompt="x", top_p=1.5), "top_p"),
    (body(prompt="x", top_k=-2), "top_k"),
    (body(prompt="x", seed="s"), "seed"),
    (body(prompt="x", stop=5), "stop"),
    (body(prompt="x", stream="yes"), "stream"),
    (body(prompt="x", n=2), "n"),
    (body(prompt="x", logprobs=2), "logprobs"),
    (body(prompt="x", echo=True), "echo"),
    (body(prompt="x", min_tokens=3), "min_tokens"),
    (body(prompt="x", model=3), "model"),
    (body(prompt="x", stream_options={"include_usage": True}), "stream_options"),
    (body(prompt="x", kv_transfer_params=[1]), "kv_transfer_params"),
    (body(prompt="x", stop_token_ids=[-1]), "stop_token_ids"),
])
def test_completion_rejects(raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_completion(raw)
    assert info.value.param == param
    assert str(info.value)


def test_chat_messages_and_max_completion_tokens() -> None:
    req = parse_chat(body(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
    ], max_completion_tokens=7))
    assert req.max_tokens == 7
    assert chat_messages(req) == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "hi there"}]


@pytest.mark.parametrize("fields, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_chat_rejects(fields: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_chat(body(**fields))
    assert info.value.param == param


def test_stop_strings_and_stop_token_ids_are_bounded() -> None:
    """The engine's thread checks every stop string and stop token id after each token of the request:
    millions of them (a 16 MiB body holds that many) slowed every request of the instance."""
    ok = parse_completion(body(prompt="x", stop=["s"] * MAX_STOP_STRINGS,
                               stop_token_ids=[1] * MAX_STOP_TOKEN_IDS))
    assert len(stop_strings(ok)) == MAX_STOP_STRINGS
    with pytest.raises(BadRequest) as info:
        stop_strings(parse_completion(body(prompt="x", stop=["s"] * (MAX_STOP_STRINGS + 1))))
    assert info.value.param == "stop"
    with pytest.raises(BadRequest) as info:
        parse_chat(body(messages=[{"role": "user", "content": "x"}], stop_token_ids=[1] * 100_000))
    assert info.value.param == "stop_token_ids"
