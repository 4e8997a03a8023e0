"""What rank 0 sends the other ranks each step (pickled over a pipe) and how they rebuild it.

A worker needs, per scheduled request, only what the forward reads: its block table, how many
tokens are computed, and the new tokens' ids (not the whole sequence, not the sampler state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from kvwire.connector.base import ConnectorMetadata, WorkerConnector
from kvwire.engine.scheduler import ScheduledRequest


@dataclasses.dataclass(frozen=True)
class ScheduledItem:
    request_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    new_token_ids: tuple[int, ...]  # all_token_ids[num_computed_tokens : + len]
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class StepMessage:
    scheduled: tuple[ScheduledItem, ...]
    metadata: ConnectorMetadata
    finished_ids: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Rank 0's KV cache sizing: every rank allocates the same number of blocks."""

    num_blocks: int
    max_model_len: int


# Builds rank r's worker connector in the worker's process (picklable: a module-level class or
# function). None: no connector (colocated serving).
WorkerConnectorFactory = Callable[[int], WorkerConnector]


class _Tokens:
    """The window of token ids a step reads, indexed like the request's full list."""

    def __init__(self, start: int, ids: tuple[int, ...]) -> None:
        self._start, self._ids = start, ids

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return list(self._ids[key.start - self._start : key.stop - self._start])
        return self._ids[key - self._start]


@dataclasses.dataclass
class _FollowerRequest:
    request_id: str
    block_ids: list[int]
    num_computed_tokens: int
    all_token_ids: _Tokens
    num_tokens: int


def to_message(
    scheduled: Iterable[ScheduledRequest], metadata: ConnectorMetadata, finished_ids: Iterable[str]
) -> StepMessage:
    items = []
    for s in scheduled:
        req, start = s.request, s.request.num_computed_tokens
        items.append(ScheduledItem(
            req.request_id, tuple(req.block_ids), start,
            tuple(req.all_token_ids[start : start + s.num_new_tokens]), req.num_tokens,
        ))  # fmt: skip
    return StepMessage(tuple(items), metadata, frozenset(finished_ids))


def from_message(msg: StepMessage) -> list[ScheduledRequest]:
    """The scheduled batch as a worker's ModelRunner reads it (duck-typed requests)."""
    return [
        ScheduledRequest(
            _FollowerRequest(  # type: ignore[arg-type]
                i.request_id, list(i.block_ids), i.num_computed_tokens,
                _Tokens(i.num_computed_tokens, i.new_token_ids), i.num_tokens,
            ),
            len(i.new_token_ids),
        )
        for i in msg.scheduled
    ]  # fmt: skip
