"""Scheduler half of the kvwire P/D connector (engine-agnostic; engine thread only, never blocks).

Push (default): P announces the transfer with the step that completes the prompt (chunked prefill:
the last chunk), the worker hands every KV layer to the agent during that forward (CPU caches: the
layers and the send's start wait for P's next step, decisions 141 and 147), and
``request_finished`` keeps the blocks (``delay_free``) until the agent reports the send acknowledged
or failed. With ``use_first_token`` P's sampled token follows as the transfer's trailer. D promises
the prompt's tokens as asynchronous external tokens, expects the transfer once blocks are allocated,
and resumes the request on ``finished_recving`` (``take_first_token`` gives P's token).

Pull: P holds the blocks under a lease (``start_send`` without a peer) and returns
``kv_transfer_params`` with its endpoints and first token; D expects with ``pull_from``.

Requests may end at any moment (abort, preemption): every phase has a defined exit that cancels the
transfer and frees (or keeps, then frees) the blocks; nothing asserts on request state.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from kvwire.connector.base import (
    ConnectorOutput,
    ConnectorRequest,
    SchedulerConnector,
    StepInfo,
    StepPlan,
    StepReport,
)
from kvwire.connector.metadata import (
    AbortSpec,
    KvwireConnectorMetadata,
    PromiseSpec,
    RecvSpec,
    SendSpec,
)
from kvwire.connector.requests import RequestHooks
from kvwire.connector.state import Phase, RequestState
from kvwire.protocol.kv_params import TransferMode

logger = logging.getLogger(__name__)


class KvwireSchedulerConnector(RequestHooks, SchedulerConnector):
    """See the module docstring: :class:`RequestHooks` (its state, and what happens per request) plus
    what happens per step. ``kv_endpoints``: this instance's agent endpoints, one per rank."""

    # --- after admission: the blocks are allocated ------------------------------------------

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or state.phase is not Phase.WAITING_ALLOC or num_external_tokens <= 0:
            return
        num_blocks = math.ceil(state.num_remote_tokens / self.engine_info.block_size)
        state.block_ids = tuple(block_ids[:num_blocks])
        state.phase = Phase.RECV_QUEUED
        state.transfer_started_s = time.monotonic()
        pull = state.params.mode is TransferMode.PULL
        self._recvs.append(
            RecvSpec(
                request_id=state.request_id,
                transfer_id=state.params.transfer_id,
                block_ids=state.block_ids,
                deadline_s=state.deadline_s,
                pull_from=tuple(state.params.peer_endpoints) if pull else (),
                want_trailer=not pull and self.config.use_first_token,
                skip_blocks=state.num_local_tokens // self.engine_info.block_size,
                sender_endpoints=() if pull else tuple(state.params.peer_endpoints),
                first_block=state.params.skip_blocks,
                peer_tp_size=len(state.params.peer_endpoints),
                limit_s=state.params.limit_s,
            )
        )

    # --- per step -------------------------------------------------------------------------------

    def plan_step(self, plan: StepPlan) -> KvwireConnectorMetadata:
        """The built-in engine's plan (decision 131): this step's allocations, then the metadata."""
        for item in plan.allocated:
            self.update_state_after_alloc(item.request, item.block_ids, item.num_external_tokens)
        return self.build_connector_meta(StepInfo(plan.scheduled, plan.finished_request_ids))

    def report_step(self, output: ConnectorOutput) -> StepReport:
        """The built-in engine's report (decision 131): the workers' output applied; P's first token
        of each request whose remote KV is loaded, when it came."""
        self.update_connector_output(output)
        first_tokens = {rid: self.take_first_token(rid) for rid in sorted(output.finished_recving)}
        return StepReport(output, {rid: t for rid, t in first_tokens.items() if t is not None})

    def build_connector_meta(self, step: StepInfo) -> KvwireConnectorMetadata:
        for chunk in step.scheduled:
            state = self._reqs.get(chunk.request_id)
            if state is None or state.phase is not Phase.PREFILLING:
                continue
            if chunk.num_computed_tokens + chunk.num_scheduled_tokens >= state.num_prompt_tokens:
                self._start_send(state, chunk.block_ids)
        for spec in self._recvs:
            state = self._reqs.get(spec.request_id)
            if state is not None and state.phase is Phase.RECV_QUEUED:
                state.phase = Phase.RECEIVING
        promises, withdrawn = self._take_admissions()
        meta = KvwireConnectorMetadata(
            sends=tuple(self._sends),
            recvs=tuple(self._recvs),
            trailers=tuple(self._trailers),
            promises=promises,
            aborts=(*self._aborts, *withdrawn),
        )
        self._sends, self._recvs, self._trailers, self._aborts = [], [], [], []
        return meta

    def _start_send(self, state: RequestState, block_ids: Sequence[int]) -> None:
        num_blocks = math.ceil(state.num_prompt_tokens / self.engine_info.block_size)
        push = state.params.mode is TransferMode.PUSH
        # Partial transfer: D holds the first blocks; the block of the last prompt token always goes.
        skip = min(state.params.skip_blocks, num_blocks - 1) if push else 0
        if skip > 0:
            self._metrics.partial_transfers.labels(side="send", outcome="started").inc()
        state.block_ids = tuple(block_ids[skip:num_blocks])
        state.phase = Phase.SENDING
        state.transfer_started_s = time.monotonic()
        self._sends.append(
            SendSpec(
                request_id=state.request_id,
                transfer_id=state.params.transfer_id,
                peer_endpoints=tuple(state.params.peer_endpoints) if push else (),
                block_ids=state.block_ids,
                deadline_s=state.deadline_s,
                with_trailer=push and self.config.use_first_token,
                pull_by=() if push else tuple(state.params.peer_endpoints),
                limit_s=state.params.limit_s,
            )
        )

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for request_id in output.finished_sending:
            self._on_send_done(request_id)
        for request_id in output.finished_recving:
            token = output.first_token_ids.get(request_id)
            self._on_recv_done(request_id, output.invalid_block_ids, token)
        for request_id in output.failed:
            state = self._reqs.get(request_id)
            if state is not None and state.phase is Phase.RECEIVING:
                self._metrics.load_failures.labels(policy="fail").inc()
                state.phase = Phase.LOCAL

    def _on_send_done(self, request_id: str) -> None:
        state = self._reqs.get(request_id)
        if state is None:
            return
        if state.phase in (Phase.SENDING, Phase.AWAITING_SEND) and state.transfer_started_s is not None:
            # From the end of P's prefill (request finished) when known: the handover proper.
            self._metrics.handover_seconds.labels(phase="transfer").observe(
                time.monotonic() - state.transfer_started_s
            )
        if state.phase is Phase.SENDING:
            state.phase = Phase.SENT
        elif state.phase in (Phase.AWAITING_SEND, Phase.ABORTING):
            if state.phase is Phase.AWAITING_SEND:
                self._metrics.blocks_awaiting_send.dec(len(state.block_ids))
            del self._reqs[request_id]

    def _on_recv_done(self, request_id: str, invalid_block_ids: frozenset[int], token: int | None) -> None:
        state = self._reqs.get(request_id)
        if state is None or state.phase is not Phase.RECEIVING:
            return
        state.phase = Phase.LOADED
        if invalid_block_ids.intersection(state.block_ids):
            self._metrics.load_failures.labels(policy="recompute").inc()
            return
        if state.transfer_started_s is not None:
            self._metrics.handover_seconds.labels(phase="d_wait").observe(
                time.monotonic() - state.transfer_started_s
            )
        if state.params.mode is TransferMode.PULL:
            token = state.params.first_token_id
        state.first_token_id = token if self.config.use_first_token else None

    def take_first_token(self, request_id: str) -> int | None:
        state = self._reqs.get(request_id)
        if state is None or state.phase is not Phase.LOADED:
            return None
        token, state.first_token_id = state.first_token_id, None
        return token

    # --- helpers --------------------------------------------------------------------------------

    def _take_admissions(self) -> tuple[tuple[PromiseSpec, ...], tuple[AbortSpec, ...]]:
        """The promises made at admission since the last step, and the admissions withdrawn."""
        with self._promises_lock:
            promises, self._promises = tuple(self._promises), []
            withdrawn, self._withdrawn = tuple(self._withdrawn), []
        return promises, withdrawn

    @property
    def num_tracked_requests(self) -> int:
        """Requests with connector state (0 once everything finished and was freed)."""
        return len(self._reqs)

    def close(self) -> None:
        self._reqs.clear()
        self._sends, self._recvs, self._trailers, self._aborts = [], [], [], []
