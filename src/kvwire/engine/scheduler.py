"""Continuous-batching scheduler: which requests run this step and how many tokens each computes.

One step has a token budget (``max_num_batched_tokens``). Running requests go first (a decode costs one
token, an unfinished prompt as much of the budget as it can take: chunked prefill), then waiting
requests in arrival order. When a running request needs a block and none is free, the most recently
admitted running request is preempted: its blocks are freed and it is recomputed later.

The scheduler half of the KV connector is asked twice a request: ``get_num_new_matched_tokens``
when a waiting request is first admitted (how many of its tokens come from a remote instance) and
``request_finished`` when it ends. Everything else of a step travels as data (decision 131): the
schedule's :class:`~kvwire.connector.base.StepPlan` (what is scheduled, what was allocated, what
ended) goes to the connector once, and its :class:`~kvwire.connector.base.StepReport` comes back to
``apply_report``. Requests whose remote KV arrives asynchronously wait in ``WAITING_FOR_REMOTE_KV``
(holding their blocks) while the others keep running.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

from kvwire.connector.base import Allocation, ScheduledChunk, SchedulerConnector, StepPlan, StepReport
from kvwire.engine.block_manager import BlockManager
from kvwire.engine.config import EngineConfig, KVLoadFailurePolicy
from kvwire.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes, from request.num_computed_tokens on

    @property
    def num_new_prompt_tokens(self) -> int:
        """How many of the scheduled tokens are prompt tokens (for statistics)."""
        start = self.request.num_computed_tokens
        return max(0, min(start + self.num_new_tokens, self.request.num_prompt_tokens) - start)

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so it samples the next one."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    plan: StepPlan  # the connector's view of the same step


@dataclasses.dataclass
class ConnectorUpdate:
    """What the engine must act on after the connector's StepReport was applied."""

    first_tokens: list[tuple[Request, int]]  # remote KV complete, with the token P sampled
    failed: list[tuple[Request, str]]  # remote KV failed and the policy is FAIL


class Scheduler:
    """Engine thread only."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, connector: SchedulerConnector) -> None:
        self.config = config
        self.blocks = blocks
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote: dict[str, Request] = {}
        self.delayed_free: dict[str, list[int]] = {}  # finished requests whose blocks a send still reads
        self._sent_early: set[str] = set()  # finished_sending seen before request_finished
        self._finished_ids: set[str] = set()  # finished since the last schedule()
        self._allocated: list[Allocation] = []  # first admissions of this schedule(), for the plan
        self.num_preemptions = 0
        self.num_kv_load_failures = 0
        self.num_kv_load_recomputes = 0
        self.num_prefix_cache_hit_tokens = 0

    # --- schedule ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        for req in list(self.running):
            if budget == 0 or req.status is not RequestStatus.RUNNING:  # preempted below
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._make_room(req, num_new):
                preempted = True
                continue
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        while not preempted and budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            if item.num_new_tokens:
                scheduled.append(item)
                budget -= item.num_new_tokens
        plan = StepPlan(
            scheduled=tuple(_chunk(s) for s in scheduled),
            finished_request_ids=frozenset(self._finished_ids),
            allocated=tuple(self._allocated),
        )
        self._finished_ids.clear()
        self._allocated.clear()
        return SchedulerOutput(scheduled, plan)

    def _make_room(self, req: Request, num_new: int) -> bool:
        """Allocate blocks so ``req`` can compute ``num_new`` more tokens, preempting from the back
        of the running list. False when ``req`` itself had to be preempted."""
        needed = self.blocks.blocks_needed(req.num_computed_tokens + num_new) - len(req.block_ids)
        while needed > self.blocks.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        req.block_ids += self.blocks.allocate(max(needed, 0))
        return True

    def _preempt(self, req: Request) -> None:
        log.debug("preempting %s", req)
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids, req.num_computed_tokens = [], 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _admit(self, req: Request, budget: int) -> ScheduledRequest | None:
        """Give the head of the waiting queue its blocks. None when they are not free yet. A request
        whose KV comes asynchronously moves to WAITING_FOR_REMOTE_KV (0 tokens scheduled)."""
        cached: list[int] = []
        num_external, load_async = 0, False
        if not req.block_ids:  # new or preempted: look for its prefix locally, then remotely
            cached = self.blocks.find_cached_blocks(req.all_token_ids, req.block_hashes)
            req.num_computed_tokens = len(cached) * self.blocks.block_size
            if not req.asked_connector:
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    req, req.num_computed_tokens
                )
                num_external = max(0, min(num_external, req.num_tokens - req.num_computed_tokens))
                load_async = load_async and num_external > 0
                if not load_async:  # a synchronous load leaves one token to compute (it samples)
                    num_external = min(num_external, req.num_tokens - req.num_computed_tokens - 1)
        start = req.num_computed_tokens + num_external
        num_new = 0 if load_async else min(req.num_tokens - start, budget)
        needed = self.blocks.blocks_needed(start + num_new) - len(req.block_ids) - len(cached)
        # Cached blocks nobody holds sit in the free list: taking them uses up free blocks too.
        if max(needed, 0) + self.blocks.num_unreferenced(cached) > self.blocks.num_free_blocks:
            return None
        self.waiting.popleft()
        self.blocks.take(cached)
        req.block_ids += cached + self.blocks.allocate(max(needed, 0))
        if cached or num_external:
            req.num_cached_tokens = start
            self.num_prefix_cache_hit_tokens += len(cached) * self.blocks.block_size
        if not req.asked_connector:  # the connector learns the blocks with this step's plan
            req.asked_connector = True
            self._allocated.append(Allocation(req, tuple(req.block_ids), num_external))
        if load_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            req.num_external_tokens = num_external
            self.waiting_for_remote[req.request_id] = req
            return ScheduledRequest(req, 0)
        req.num_computed_tokens = start
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return ScheduledRequest(req, num_new)

    # --- after the forward pass ---------------------------------------------------------------------

    def advance(self, scheduled: list[ScheduledRequest]) -> None:
        """The step computed the scheduled tokens' KV: move the counters, cache newly full blocks."""
        block_size = self.blocks.block_size
        for item in scheduled:
            req = item.request
            before = req.num_computed_tokens
            req.num_computed_tokens += item.num_new_tokens
            if req.num_computed_tokens // block_size > before // block_size:  # most decodes fill none
                self.blocks.cache_blocks(
                    req.all_token_ids, req.block_ids, req.num_computed_tokens, req.block_hashes
                )

    def finish(self, req: Request, status: RequestStatus) -> dict[str, Any] | None:
        """End a request in any state. Returns the connector's kv_transfer_params for the client."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_remote[req.request_id]
        req.status = status
        delay_free, params = self.connector.request_finished(req, list(req.block_ids))
        if delay_free and req.block_ids and req.request_id not in self._sent_early:
            self.delayed_free[req.request_id] = req.block_ids
        else:
            self.blocks.free(req.block_ids)
        self._sent_early.discard(req.request_id)
        req.block_ids = []
        self._finished_ids.add(req.request_id)
        return params

    def apply_report(self, report: StepReport, live: dict[str, Request]) -> ConnectorUpdate:
        """Apply the connector's report: free delayed blocks, resume or fail remote loads."""
        output = report.output
        update = ConnectorUpdate([], [])
        for request_id in output.finished_sending:
            self._release(request_id, live)
        for request_id, reason in output.failed.items():
            if request_id in self.waiting_for_remote:
                self._load_failed(self.waiting_for_remote[request_id], reason, update)
            elif request_id in self.delayed_free or request_id in live:
                log.warning("KV send of %s failed: %s", request_id, reason)
                self._release(request_id, live)
        if output.invalid_block_ids:
            for req in [*self.waiting_for_remote.values(), *self.running]:
                if not output.invalid_block_ids.isdisjoint(req.block_ids):
                    self._load_failed(req, "remote KV blocks failed to load", update)
        for request_id in output.finished_recving:
            waiting = self.waiting_for_remote.get(request_id)
            if waiting is not None:
                self._resume(waiting, report.first_tokens.get(request_id), update)
        return update

    def release_all_delayed(self) -> None:
        """Free every block held for a send (the engine ended: its connectors are closed, no send
        reads them any more)."""
        for blocks in self.delayed_free.values():
            self.blocks.free(blocks)
        self.delayed_free.clear()
        self._sent_early.clear()

    def _release(self, request_id: str, live: dict[str, Request]) -> None:
        blocks = self.delayed_free.pop(request_id, None)
        if blocks is not None:
            self.blocks.free(blocks)
        elif request_id in live:
            self._sent_early.add(request_id)

    def _resume(self, req: Request, token: int | None, update: ConnectorUpdate) -> None:
        """All remote KV of ``req`` arrived (``token``: P's first token, if it came): it continues as
        a waiting request that holds its blocks."""
        del self.waiting_for_remote[req.request_id]
        req.num_computed_tokens += req.num_external_tokens
        req.num_cached_tokens = req.num_computed_tokens
        first_token = None
        if req.num_computed_tokens == req.num_tokens:
            first_token = token
            if first_token is None:
                req.num_computed_tokens -= 1  # recompute the last prompt token to sample the first
        self.blocks.cache_blocks(req.all_token_ids, req.block_ids, req.num_computed_tokens, req.block_hashes)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        if first_token is not None:
            update.first_tokens.append((req, first_token))

    def _load_failed(self, req: Request, reason: str, update: ConnectorUpdate) -> None:
        log.warning(
            "remote KV for %s failed (%s); policy %s",
            req.request_id,
            reason,
            self.config.kv_load_failure_policy.value,
        )
        self.num_kv_load_failures += 1
        self.blocks.invalidate(req.block_ids)
        if self.config.kv_load_failure_policy is KVLoadFailurePolicy.FAIL:
            update.failed.append((req, reason))
            return
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_remote[req.request_id]
        else:
            self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids, req.num_computed_tokens, req.num_cached_tokens = [], 0, 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_kv_load_recomputes += 1


def _chunk(item: ScheduledRequest) -> ScheduledChunk:
    req = item.request
    return ScheduledChunk(
        request_id=req.request_id,
        block_ids=tuple(req.block_ids),
        num_computed_tokens=req.num_computed_tokens,
        num_scheduled_tokens=item.num_new_tokens,
        num_prompt_tokens=req.num_prompt_tokens,
    )
