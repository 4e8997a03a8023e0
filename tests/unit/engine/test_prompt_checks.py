"""The prompt token-id checks at HTTP admission (``prompt_token_source``) and at the engine
(``LLMEngine._validate``) take a C-speed path when every id is exactly an int (decision 158) and
decide as the per-item check did: bools, floats, strings and out-of-range ids are refused, an int
subclass passes."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from kvwire.engine.llm_engine import _token_ids_below
from kvwire.server.openai_protocol import _all_token_ids


class _Token(enum.IntEnum):
    A = 3


def _slow_all_token_ids(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def _slow_below(values: list[Any], vocab: int) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in values)


CASES: list[list[Any]] = [
    [1, 2, 3], [0], [99], [100], [-1, 5], [1, True], [True], [1, 2.0], [1, "2"], [1, None],
    [1, [2]], [_Token.A, 4], [_Token.A], [], list(range(100)), [*range(50), False],
]


@pytest.mark.parametrize("values", CASES, ids=repr)
def test_the_fast_checks_decide_as_the_per_item_ones(values: list[Any]) -> None:
    assert _all_token_ids(values) == _slow_all_token_ids(values)
    assert _token_ids_below(values, 100) == _slow_below(values, 100)


def test_bools_and_out_of_range_ids_are_refused() -> None:
    assert not _all_token_ids([1, True])
    assert not _token_ids_below([1, False], 100)
    assert not _token_ids_below([1, 100], 100)
    assert not _token_ids_below([-1, 2], 100)
    assert _token_ids_below([0, 99], 100)
