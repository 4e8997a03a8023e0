"""vLLM's ``request_id`` request field: the answer's id (checked at the edge, decision 121)."""

from __future__ import annotations

import pytest

from kvwire.server.openai_protocol import (
    BadRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)


def test_request_id_accepted_and_checked() -> None:
    assert parse_completion(b'{"prompt": "x", "request_id": "ab-12.c:d_e"}').request_id == "ab-12.c:d_e"
    assert parse_chat(b'{"messages": [{"role": "user", "content": "x"}]}').request_id is None
    for bad in ('""', '"a b"', '"' + "x" * 257 + '"', '"id\\n"', '"\u00e9"'):
        with pytest.raises(BadRequest) as err:
            parse_completion(b'{"prompt": "x", "request_id": ' + bad.encode() + b"}")
        assert err.value.param == "request_id"


def test_tokenize_bodies() -> None:
    assert parse_tokenize(b'{"prompt": "x", "add_special_tokens": false}').add_special_tokens is False
    with pytest.raises(BadRequest):
        parse_tokenize(b'{"model": "m"}')  # neither prompt nor messages
    with pytest.raises(BadRequest):
        parse_tokenize(b'{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}')
    assert parse_detokenize(b'{"tokens": [1, 2]}', vocab_size=3).tokens == [1, 2]
    with pytest.raises(BadRequest):
        parse_detokenize(b'{"tokens": [3]}', vocab_size=3)
