"""Scheduler-side adapters between vLLM's scheduler objects and the engine-agnostic connector core.

Pure Python, duck-typed (no vLLM import), so it is unit-tested in the main venv.

* :class:`StepTracker` turns vLLM's ``SchedulerOutput`` into the core's :class:`StepInfo`. vLLM gives
  a running request's *new* blocks only, so the tracker keeps each request's full block list (and
  prompt length) from the step that first scheduled it until it finishes.
* :class:`DeliveryLedger` guards vLLM's completion bookkeeping. vLLM's scheduler asserts that every id
  it receives in ``finished_sending`` is a finished request whose blocks it holds for the connector
  (``request_finished`` returned ``True``), and every id in ``finished_recving`` is a request it parked
  in ``WAITING_FOR_REMOTE_KVS`` (or that finished while parked). The core reports "blocks may be freed"
  through ``finished_sending`` on both sides (a cancelled receive on D too) and may see a send
  acknowledged while the request is still running. The ledger rewrites each step's sets so that vLLM
  sees exactly one completion per promise, in the set it expects, and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from kvwire.connector.base import ScheduledChunk, StepInfo


@dataclasses.dataclass
class _Tracked:
    block_ids: list[int]
    num_prompt_tokens: int


class StepTracker:
    """Scheduler thread only. Feed every ``SchedulerOutput`` to :meth:`step_info` once, in order."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Tracked] = {}

    def step_info(self, scheduler_output: Any) -> StepInfo:
        chunks: list[ScheduledChunk] = []
        num_scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = _Tracked(list(_first_group(new.block_ids)), len(new.prompt_token_ids or ()))
            self._reqs[new.req_id] = tracked
            chunks.append(self._chunk(new.req_id, tracked, new.num_computed_tokens, num_scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            tracked_or_none = self._reqs.get(req_id)
            if tracked_or_none is None:
                continue  # scheduled before this connector saw it (cannot happen in vLLM >= 0.32)
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in resumed:  # a resumed request gets its whole (new) block list
                    tracked_or_none.block_ids = list(_first_group(new_blocks))
                else:
                    tracked_or_none.block_ids.extend(_first_group(new_blocks))
            chunks.append(
                self._chunk(req_id, tracked_or_none, cached.num_computed_tokens[i], num_scheduled)
            )
        finished = frozenset(scheduler_output.finished_req_ids or ())
        for req_id in finished:
            self._reqs.pop(req_id, None)
        return StepInfo(scheduled=tuple(chunks), finished_request_ids=finished)

    @staticmethod
    def _chunk(
        req_id: str, tracked: _Tracked, num_computed: int, num_scheduled: dict[str, int]
    ) -> ScheduledChunk:
        return ScheduledChunk(
            request_id=req_id,
            block_ids=tuple(tracked.block_ids),
            num_computed_tokens=num_computed,
            num_scheduled_tokens=num_scheduled.get(req_id, 0),
            num_prompt_tokens=tracked.num_prompt_tokens,
        )

    @property
    def num_tracked(self) -> int:
        return len(self._reqs)


def _first_group(block_ids: Any) -> list[int]:
    """vLLM passes one block-id list per KV cache group; kvwire supports one group (full attention)."""
    if not block_ids:
        return []
    if len(block_ids) != 1:
        raise ValueError(f"KvwireConnector supports one KV cache group, got {len(block_ids)}")
    return list(block_ids[0])


class DeliveryLedger:
    """What vLLM waits for, and the per-step rewrite of the completion sets (scheduler thread only)."""

    def __init__(self) -> None:
        self._await_recv: set[str] = set()  # parked in WAITING_FOR_REMOTE_KVS: one finished_recving due
        self._await_send: set[str] = set()  # request_finished said delay: one finished_sending due

    def promised_load(self, request_id: str) -> None:
        """``update_state_after_alloc`` with external tokens of an async load: vLLM parks the request."""
        self._await_recv.add(request_id)

    def delayed_free(self, request_id: str) -> None:
        """``request_finished`` returned ``delay_free=True``. A request still parked for its load needs
        no send completion: vLLM frees it on the (possibly cancelled) load's ``finished_recving``."""
        if request_id not in self._await_recv:
            self._await_send.add(request_id)

    def rewrite(
        self, finished_sending: Iterable[str], finished_recving: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        """The core's completions -> the (finished_sending, finished_recving) vLLM may see now."""
        done = set(finished_sending) | set(finished_recving)
        recving = done & self._await_recv
        self._await_recv -= recving
        sending = (set(finished_sending) - recving) & self._await_send
        self._await_send -= sending
        return sending, recving

    @property
    def num_outstanding(self) -> int:
        return len(self._await_recv) + len(self._await_send)

    def has_pending_sends(self) -> bool:
        return bool(self._await_send)
