"""FirstTokenSplicer: P's first token streamed early, then trimmed off D's stream."""

from __future__ import annotations

import json
from typing import Any

from kvwire.router.relay import FirstTokenSplicer


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def texts(stream: bytes, chat: bool) -> list[str]:
    out = []
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            choice = json.loads(event[6:])["choices"][0]
            out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return out


def p_answer(text: str, chat: bool) -> bytes:
    choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return json.dumps({"id": "cmpl-p", "created": 1, "model": "m", "choices": [choice]}).encode()


def d_stream(pieces: list[str], chat: bool) -> bytes:
    events = [sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]})] if chat else []
    for i, piece in enumerate(pieces):
        fin = "length" if i == len(pieces) - 1 else None
        choice = {"delta": {"content": piece}} if chat else {"text": piece}
        events.append(sse({"id": "cmpl-d", "choices": [dict(choice, finish_reason=fin)]}))
    return b"".join(events) + b"data: [DONE]\n\n"


def run(splicer: FirstTokenSplicer, stream: bytes, step: int) -> bytes:
    out = b"".join(splicer.filter(stream[i:i + step]) for i in range(0, len(stream), step))
    return out + splicer.flush()


def test_completion_stream_spliced_across_chunk_boundaries() -> None:
    for step in (1, 7, 10_000):
        sp = FirstTokenSplicer.from_prefill(p_answer(" Hello", False), chat=False)
        assert sp is not None
        early = sp.early_events()
        rest = run(sp, d_stream([" Hello", " world", "!"], False), step)
        assert texts(early, False) + texts(rest, False) == [" Hello", " world", "!"]
        assert rest.endswith(b"data: [DONE]\n\n")


def test_chat_role_chunk_sent_once_and_merged_tokens_trimmed() -> None:
    sp = FirstTokenSplicer.from_prefill(p_answer("Hi", True), chat=True)
    assert sp is not None
    early = sp.early_events()
    rest = run(sp, d_stream(["Hi there", " you"], True), 5)  # D merged tokens 1 and 2 in one event
    assert texts(early, True) == ["", "Hi"]  # role chunk, then P's token
    assert texts(rest, True) == [" there", " you"]
    assert b'"role"' not in rest


def test_finish_event_kept_when_the_only_token_is_p_s() -> None:
    sp = FirstTokenSplicer.from_prefill(p_answer("x", False), chat=False)
    assert sp is not None
    rest = run(sp, d_stream(["x"], False), 3)
    events = [json.loads(e[6:]) for e in rest.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["choices"][0]["text"] for e in events] == [""]
    assert events[0]["choices"][0]["finish_reason"] == "length"


def test_mismatch_stops_splicing_and_passes_through() -> None:
    sp = FirstTokenSplicer.from_prefill(p_answer(" A", False), chat=False)
    assert sp is not None
    stream = d_stream([" B", " C"], False)
    assert run(sp, stream, 4) == stream


def test_no_splicer_for_empty_or_odd_answers() -> None:
    assert FirstTokenSplicer.from_prefill(p_answer("", False), chat=False) is None
    assert FirstTokenSplicer.from_prefill(b"not json", chat=False) is None
    two = json.dumps({"choices": [{"text": "a"}, {"text": "b"}]}).encode()
    assert FirstTokenSplicer.from_prefill(two, chat=False) is None


def test_each_complete_event_is_released_at_once_lf_or_crlf() -> None:
    """Nothing is held past its event's blank line (a CRLF stream was held until its end)."""
    for sep in (b"\n\n", b"\r\n\r\n"):
        sp = FirstTokenSplicer.from_prefill(p_answer(" a", False), chat=False)
        assert sp is not None
        events = [e + b"\n\n" for e in d_stream([" a", " b", " c"], False).split(b"\n\n") if e]
        events = [e.replace(b"\n\n", sep) for e in events]
        assert texts(sp.filter(events[0]), False) == []  # P's token: trimmed, nothing to send
        assert sp.filter(events[1]) == events[1]  # matched: the next event passes at once, unchanged
        assert sp.filter(events[2][:10]) == events[2][:10]  # and from then on every byte as it comes
        assert sp.flush() == b""


def p_answer_ids(text: str, ids: list[int], prompt_ids: list[int]) -> bytes:
    choice = {"text": text, "token_ids": ids}
    return json.dumps({"id": "cmpl-x", "created": 1, "model": "m", "choices": [choice],
                       "prompt_token_ids": prompt_ids}).encode()


def d_stream_ids(pieces: list[tuple[str, list[int]]]) -> bytes:
    events = []
    for i, (piece, ids) in enumerate(pieces):
        data: dict[str, Any] = {"id": "cmpl-x", "choices": [
            {"text": piece, "token_ids": ids, "finish_reason": "length" if i == len(pieces) - 1 else None}]}
        if i == 0:
            data.update(prompt_token_ids=[1, 2, 3], kvwire_max_tokens=3)
        events.append(sse(data))
    return b"".join(events) + b"data: [DONE]\n\n"


def test_token_ids_trimmed_and_budget_kept_for_the_ledger() -> None:
    sp = FirstTokenSplicer.from_prefill(p_answer_ids("a", [10], [1, 2, 3]), chat=False)
    assert sp is not None and sp.token_ids == [10]
    early = [json.loads(e[6:]) for e in sp.early_events().split(b"\n\n") if e.startswith(b"data: {")]
    assert early[0]["prompt_token_ids"] == [1, 2, 3] and early[0]["choices"][0]["token_ids"] == [10]
    rest = run(sp, d_stream_ids([("a", [10]), ("bc", [11, 12])]), 6)
    events = [json.loads(e[6:]) for e in rest.split(b"\n\n") if e.startswith(b"data: {")]
    # D's first event keeps only the budget (the ledger reads and drops it); prompt ids went out early
    assert events[0]["kvwire_max_tokens"] == 3 and "prompt_token_ids" not in events[0]
    assert events[0]["choices"][0]["token_ids"] == [] and events[0]["choices"][0]["text"] == ""
    assert [e["choices"][0]["token_ids"] for e in events[1:]] == [[11, 12]]
    assert not sp.diverged


def test_other_first_token_id_diverges_and_withholds_the_rest() -> None:
    sp = FirstTokenSplicer.from_prefill(p_answer_ids("a", [10], [1, 2, 3]), chat=False)
    assert sp is not None
    rest = run(sp, d_stream_ids([("a", [99]), ("b", [11])]), 5)
    assert sp.diverged and rest == b""  # nothing of D's answer reaches the client


def test_same_id_other_text_diverges() -> None:
    sp = FirstTokenSplicer.from_prefill(p_answer_ids("a", [10], [1, 2, 3]), chat=False)
    assert sp is not None
    assert run(sp, d_stream_ids([("z", [10]), ("b", [11])]), 10_000) == b"" and sp.diverged


def _ledger(return_ids: bool) -> Any:
    import msgspec

    from kvwire.router.request import StreamLedger, parse_client_request

    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 3, "return_token_ids": return_ids}
    ledger = StreamLedger.for_request(parse_client_request("/v1/completions", msgspec.json.encode(body), {}))
    assert ledger is not None
    return ledger


def test_spliced_stream_through_the_ledger_is_what_the_client_sees() -> None:
    """P's early event and D's trimmed stream, through the migration ledger: the client sees each token
    once, no router field, no empty event; the ledger knows every id and D's budget."""
    for return_ids in (False, True):
        ledger = _ledger(return_ids)
        sp = FirstTokenSplicer.from_prefill(p_answer_ids("a", [10], [1, 2, 3]), chat=False)
        assert sp is not None
        client = ledger.filter(sp.early_events())
        client += ledger.filter(run(sp, d_stream_ids([("a", [10]), ("bc", [11, 12])]), 7))
        events = [json.loads(e[6:]) for e in client.split(b"\n\n") if e.startswith(b"data: {")]
        assert [e["choices"][0]["text"] for e in events] == ["a", "bc"]
        assert all("kvwire_max_tokens" not in e for e in events)
        assert ("prompt_token_ids" in events[0]) == return_ids
        assert [e["choices"][0].get("token_ids") for e in events] == ([[10], [11, 12]] if return_ids
                                                                       else [None, None])
        assert ledger.token_ids == [10, 11, 12] and ledger.max_tokens == 3 and ledger.prompt_ids == [1, 2, 3]
        assert client.endswith(b"data: [DONE]\n\n") and ledger.finished


def test_divergence_leaves_the_ledger_at_p_s_token_for_a_continuation() -> None:
    ledger = _ledger(False)
    sp = FirstTokenSplicer.from_prefill(p_answer_ids("a", [10], [1, 2, 3]), chat=False)
    assert sp is not None
    ledger.filter(sp.early_events())
    assert ledger.filter(run(sp, d_stream_ids([("z", [99]), ("b", [11])]), 4)) == b""
    assert sp.diverged and ledger.can_continue()
    assert ledger.continuation().body["prompt"] == [1, 2, 3, 10]  # continues after P's token
