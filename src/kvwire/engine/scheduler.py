"""Continuous-batching scheduler: which requests run this step and how many tokens each computes,
and the KV blocks they hold (:class:`BlockManager`, at the end of this module).

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

The engine calls it three times a step: ``schedule``, ``postprocess`` (after the forward pass and
the engine's stop checks: counters, newly full blocks, the requests that stopped end) and
``apply_report``; ``finish`` ends a request at any other time (abort, error).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvwire.connector.base import Allocation, ScheduledChunk, SchedulerConnector, StepPlan, StepReport
from kvwire.engine.config import EngineConfig, KVLoadFailurePolicy
from kvwire.protocol.kv_blocks import BlockHash, KvEventLog, block_hashes

if TYPE_CHECKING:
    from kvwire.engine.llm_engine import Request

log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    """A request's state: the scheduler moves it between the first three; ``finish`` sets the last."""

    WAITING = "waiting"  # queued; not yet (or no longer, after preemption) holding KV blocks
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated; a connector is loading them
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


# What a finished request's output says (RequestOutput.finish_reason), by status.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclasses.dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes, from request.num_computed_tokens on
    # True when this step reaches the request's last token, so it samples the next one (set here:
    # the model runner reads it for every request of the step)
    samples: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    plan: StepPlan  # the connector's view of the same step
    num_new_prompt_tokens: int = 0  # how many of the scheduled tokens are prompt tokens (statistics)


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
        return SchedulerOutput(scheduled, plan, sum(_num_new_prompt_tokens(s) for s in scheduled))

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

    def postprocess(
        self, scheduled: list[ScheduledRequest], stopped: list[tuple[Request, RequestStatus]]
    ) -> list[tuple[Request, RequestStatus, dict[str, Any] | None]]:
        """After the forward pass and the engine's stop checks: move the counters and cache the newly
        full blocks (:meth:`advance`), then end the requests that stopped, in order (:meth:`finish`).
        Returns each ended request with its status and the connector's kv_transfer_params."""
        self.advance(scheduled)
        return [(req, status, self.finish(req, status)) for req, status in stopped]

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


def _num_new_prompt_tokens(item: ScheduledRequest) -> int:
    """How many of the scheduled tokens are prompt tokens."""
    start = item.request.num_computed_tokens
    return max(0, min(start + item.num_new_tokens, item.request.num_prompt_tokens) - start)


def _chunk(item: ScheduledRequest) -> ScheduledChunk:
    req = item.request
    return ScheduledChunk(
        request_id=req.request_id,
        block_ids=tuple(req.block_ids),
        num_computed_tokens=req.num_computed_tokens,
        num_scheduled_tokens=item.num_new_tokens,
        num_prompt_tokens=req.num_prompt_tokens,
    )


# --- KV blocks ------------------------------------------------------------------------------------
# KV block allocation with reference counts and prefix caching.
#
# Each block holds ``block_size`` tokens of every layer's KV. A block is *free* when no request holds it
# (ref count 0). A full block whose KV was computed is registered under a hash of its tokens and of
# every token before it (a hash chain); a later request with the same prefix takes the block instead
# of recomputing it. Free blocks stay cached until they are reused (least recently freed first).
# The hashes are those of :mod:`kvwire.protocol.kv_blocks` (shared with the router); every hash that enters or
# leaves the cache is reported to the optional :class:`~kvwire.protocol.kv_blocks.KvEventLog` (KV events).


class BlockManager:
    """Owned by the scheduler (engine thread only)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        events: KvEventLog | None = None,
    ) -> None:
        self.events = events
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self.num_used_blocks = 0  # blocks some request holds (a plain field: read by every stats())
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self._hash_of_block: dict[int, BlockHash] = {}
        self._block_of_hash: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` no request holds (they are in the free list)."""
        return sum(1 for block in block_ids if self._ref_counts[block] == 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ---------------------------------------------------------------------------

    def block_hashes(
        self, token_ids: Sequence[int], num_tokens: int, memo: list[BlockHash] | None = None
    ) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids[:num_tokens]``. ``memo`` (a request's
        list, extended in place) keeps earlier blocks' hashes so each block is hashed once."""
        return block_hashes(token_ids, self.block_size, max(num_tokens, 0), memo)

    def find_cached_blocks(self, token_ids: Sequence[int], memo: list[BlockHash] | None = None) -> list[int]:
        """Longest run of cached blocks that prefixes ``token_ids``, leaving at least one token to
        compute (the step that computes it samples the next token). Takes no references."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for block_hash in self.block_hashes(token_ids, len(token_ids) - 1, memo):
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def cache_blocks(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed_tokens: int,
        memo: list[BlockHash] | None = None,
    ) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(token_ids, num_computed_tokens, memo)
        new: list[BlockHash] = []
        for block, block_hash in zip(block_ids, hashes, strict=False):
            if block not in self._hash_of_block and block_hash not in self._block_of_hash:
                self._block_of_hash[block_hash] = block
                self._hash_of_block[block] = block_hash
                new.append(block_hash)
        if new and self.events is not None:
            self.events.stored(new)

    # --- allocation -------------------------------------------------------------------------------

    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to blocks found by :meth:`find_cached_blocks`."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                del self._free[block]
                self.num_used_blocks += 1
            self._ref_counts[block] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks (evicting cached ones, least recently freed first)."""
        if num_blocks > len(self._free):
            raise MemoryError(f"{num_blocks} KV blocks asked, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        self.num_used_blocks += num_blocks
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Tail blocks are freed first so that they are evicted
        before the prefix blocks other requests are more likely to share."""
        for block in reversed(block_ids):
            assert self._ref_counts[block] > 0, f"block {block} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                self.num_used_blocks -= 1

    def invalidate(self, block_ids: Sequence[int]) -> None:
        """Forget the cached content of blocks (their KV is wrong, e.g. a failed remote load)."""
        for block in block_ids:
            self._evict(block)

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None and self._block_of_hash.get(block_hash) == block:
            del self._block_of_hash[block_hash]
            if self.events is not None:
                self.events.removed((block_hash,))
