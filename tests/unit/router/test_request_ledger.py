"""StreamLedger: what a streaming client was sent, and continuation events rewritten into its stream."""

from __future__ import annotations

from typing import Any

import msgspec

from kvwire.router.request import StreamLedger, parse_client_request


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def _events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else msgspec.json.decode(payload))
    return out


BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "tiny"}


def _chat_ledger(**body: Any) -> StreamLedger:
    req = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
           "max_tokens": 10, **body}
    creq = parse_client_request("/v1/chat/completions", msgspec.json.encode(req), {})
    ledger = StreamLedger.for_request(creq)
    assert ledger is not None
    return ledger


def _chat_start(ledger: StreamLedger) -> bytes:
    role = dict(BASE, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None}], prompt_token_ids=[1, 2, 3], kvwire_max_tokens=10)
    tokens = [dict(BASE, choices=[{"index": 0, "delta": {"content": t}, "finish_reason": None,
                                   "token_ids": [i]}]) for i, t in ((11, "a"), (12, "b"))]
    raw = b"".join(_sse(e) for e in (role, *tokens))
    return ledger.filter(raw[:25]) + ledger.filter(raw[25:])  # events split across chunks


def test_token_ids_are_recorded_and_stripped_for_the_client() -> None:
    ledger = _chat_ledger()
    events = _events(_chat_start(ledger))
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e for e in events)
    assert ledger.prompt_ids == [1, 2, 3] and ledger.token_ids == [11, 12] and ledger.max_tokens == 10
    assert ledger.interrupted and ledger.can_continue()


def test_error_event_is_withheld_and_marks_the_stream_interrupted() -> None:
    ledger = _chat_ledger()
    _chat_start(ledger)
    out = ledger.filter(_sse({"error": {"message": "engine error"}}) + b"data: [DONE]\n\n")
    assert out == b"" and ledger.error == "engine error" and ledger.interrupted


def test_continuation_prompt_budget_and_rewritten_events() -> None:
    ledger = _chat_ledger(temperature=0.0, stream_options={"include_usage": True}, return_token_ids=True)
    _chat_start(ledger)
    cont = ledger.continuation()
    assert cont.path == "/v1/completions"
    assert cont.body["prompt"] == [1, 2, 3, 11, 12] and cont.body["max_tokens"] == 8
    assert cont.body["temperature"] == 0.0 and "messages" not in cont.body
    other = {"id": "cmpl-2", "object": "text_completion", "created": 99, "model": "tiny"}
    upstream = [
        dict(other, choices=[{"index": 0, "text": "c", "finish_reason": None, "token_ids": [13]}],
             prompt_token_ids=[1, 2, 3, 11, 12]),
        dict(other, choices=[{"index": 0, "text": "", "finish_reason": "length", "token_ids": []}]),
        dict(other, choices=[], usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}),
    ]
    events = _events(ledger.filter(b"".join(_sse(e) for e in upstream) + b"data: [DONE]\n\n"))
    assert events[-1] == "[DONE]" and not ledger.interrupted
    first, last, usage = events[:3]
    assert {k: first[k] for k in BASE} == BASE  # same id, object, creation time, model
    assert first["choices"][0]["delta"] == {"content": "c"} and first["choices"][0]["token_ids"] == [13]
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert ledger.token_ids == [11, 12, 13]


def test_completion_without_max_tokens_uses_the_openai_default() -> None:
    req = {"model": "tiny", "prompt": [5, 6], "stream": True}
    creq = parse_client_request("/v1/completions", msgspec.json.encode(req), {})
    ledger = StreamLedger.for_request(creq)
    assert ledger is not None
    event = {"id": "c", "object": "text_completion", "created": 1, "model": "tiny",
             "choices": [{"index": 0, "text": "x", "finish_reason": None, "token_ids": [9]}],
             "prompt_token_ids": [5, 6]}
    ledger.filter(_sse(event))
    assert ledger.continuation().body["max_tokens"] == 15


def test_multiple_choices_are_not_migrated() -> None:
    req = {"model": "tiny", "prompt": "x", "stream": True, "n": 2}
    creq = parse_client_request("/v1/completions", msgspec.json.encode(req), {})
    assert StreamLedger.for_request(creq) is None


def test_a_stream_without_token_ids_cannot_continue() -> None:
    ledger = _chat_ledger()
    ledger.filter(_sse(dict(BASE, choices=[{"index": 0, "delta": {"content": "a"}, "finish_reason": None}])))
    assert not ledger.can_continue()
