"""Scheduler half of the kvwire P/D connector (engine-agnostic; engine thread only, never blocks).

Push (default): P announces the transfer with the step that completes the prompt (chunked prefill:
the last chunk), the worker hands every KV layer to the agent during that forward, and
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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvwire.connector.base import (
    ConnectorOutput,
    ConnectorRequest,
    SchedulerConnector,
    StepInfo,
    StepPlan,
    StepReport,
)
from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.first_token_trailer import FirstTokenTrailer
from kvwire.connector.metadata import (
    AbortSpec,
    KvwireConnectorMetadata,
    PromiseSpec,
    RecvSpec,
    SendSpec,
    TrailerSpec,
)
from kvwire.connector.metrics import ConnectorMetrics, connector_metrics
from kvwire.connector.state import Phase, RequestState
from kvwire.errors import InvalidRequestError
from kvwire.protocol.kv_params import KVCacheLayout, KVTransferParams, Role, TransferMode, layout_mismatch

logger = logging.getLogger(__name__)

_ACCEPTS: dict[Role, frozenset[Role]] = {
    Role.PREFILL: frozenset({Role.PREFILL}),
    Role.DECODE: frozenset({Role.DECODE}),
    Role.BOTH: frozenset({Role.PREFILL, Role.DECODE}),
}


def first_output_token(request: ConnectorRequest) -> int | None:
    """The first sampled token of a finished request, when the host exposes ``output_token_ids``
    (the built-in engine and vLLM do); ``None`` when the request ended before sampling."""
    tokens = getattr(request, "output_token_ids", None)
    if not tokens:
        return None
    return int(tokens[0])


class KvwireSchedulerConnector(SchedulerConnector):
    """See the module docstring. ``kv_endpoints``: this instance's agent endpoints, one per rank."""

    def __init__(
        self,
        config: ConnectorConfig,
        engine_info: EngineInfo,
        kv_endpoints: Sequence[str],
        *,
        instance_id: str | None = None,
        metrics: ConnectorMetrics | None = None,
    ) -> None:
        self.config = config
        self.engine_info = engine_info
        self.kv_endpoints: tuple[str, ...] = tuple(kv_endpoints)
        self.kv_layout: KVCacheLayout | None = None  # set by the host once the model is loaded
        self.instance_id = instance_id
        self._metrics = metrics if metrics is not None else connector_metrics()
        self._reqs: dict[str, RequestState] = {}
        self._sends: list[SendSpec] = []
        self._recvs: list[RecvSpec] = []
        self._trailers: list[TrailerSpec] = []
        self._aborts: list[AbortSpec] = []
        self._promises: list[PromiseSpec] = []  # appended by any thread (admission): under the lock
        self._promises_lock = threading.Lock()
        # Set by a host whose worker runs in this process (built-in server, TP 1): each promise is also
        # made at once, on the admission thread, not only at the next engine step (decision 123).
        self.promise_now: Callable[[PromiseSpec], None] | None = None

    # --- request admission -------------------------------------------------------------------

    def check_request_params(self, raw: object) -> KVTransferParams:
        """For the server's request validation (becomes HTTP 400): well-formed ``kv_transfer_params``
        with a role this instance serves, typed. Raises :class:`InvalidRequestError`. Any thread."""
        params = raw if isinstance(raw, KVTransferParams) else KVTransferParams.from_dict(raw)
        if params.role not in _ACCEPTS[self.config.role]:
            raise InvalidRequestError(
                f"kv_transfer_params.role {params.role.value!r} is not served by this "
                f"{self.config.role.value} instance"
            )
        if params.role is Role.PREFILL and params.mode is TransferMode.PUSH and not params.peer_endpoints:
            raise InvalidRequestError("push mode: kv_transfer_params.peer_endpoints (D's) must not be empty")
        self._check_layout(params)
        if params.role is Role.DECODE and params.mode is TransferMode.PULL and not params.peer_endpoints:
            raise InvalidRequestError("pull mode: kv_transfer_params.peer_endpoints (P's) must not be empty")
        self._promise(params)  # P: D may wait for this request's KV from now on
        return params

    def _check_layout(self, params: KVTransferParams) -> None:
        """The handshake's compatibility check: raise InvalidRequestError when the peer's KV cannot
        be used here (another model, dtype, block size or head layout; an unusable TP size)."""
        peer = params.peer_kv_layout
        if peer is None or self.kv_layout is None:
            return
        reason = layout_mismatch(self.kv_layout, peer)
        if reason is None and len(params.peer_endpoints) not in (0, peer.tp_size):
            reason = f"{len(params.peer_endpoints)} peer endpoints for tensor-parallel size {peer.tp_size}"
        if reason is not None:
            raise InvalidRequestError(f"incompatible P/D pair: {reason}")

    def _promise(self, params: KVTransferParams) -> None:
        """P in push mode accepted a request: its agents renew D's lease until the send starts."""
        if params.role is not Role.PREFILL or params.mode is not TransferMode.PUSH:
            return
        spec = PromiseSpec(params.transfer_id, tuple(params.peer_endpoints),
                           min(params.deadline_s, self.config.deadline_s), params.limit_s)
        with self._promises_lock:
            self._promises.append(spec)
        if self.promise_now is not None:
            self.promise_now(spec)

    def _params_for(self, request: ConnectorRequest) -> KVTransferParams | None:
        raw = request.kv_transfer_params
        if raw is None:
            return None
        try:
            params = KVTransferParams.parse(raw)
            self._check_layout(params)
        except InvalidRequestError as exc:
            logger.warning("request %s: ignoring kv_transfer_params: %s", request.request_id, exc)
            return None
        if params.role not in _ACCEPTS[self.config.role]:
            logger.warning(
                "request %s: role %s not served by a %s instance; running it locally",
                request.request_id, params.role.value, self.config.role.value,
            )
            return None
        return params

    def _new_state(self, request: ConnectorRequest, params: KVTransferParams) -> RequestState:
        limit_s = self.config.lease_s if params.mode is TransferMode.PULL else self.config.deadline_s
        prefill = params.role is Role.PREFILL
        state = RequestState(
            request_id=request.request_id,
            params=params,
            phase=Phase.PREFILLING if prefill else Phase.WAITING_ALLOC,
            num_prompt_tokens=len(request.prompt_token_ids),
            deadline_s=min(params.deadline_s, limit_s),
        )
        if prefill and params.mode is TransferMode.PUSH and not params.peer_endpoints:
            logger.warning("request %s: push without D endpoints; not sending", request.request_id)
            state.phase = Phase.LOCAL
        elif prefill:
            self._promise(params)  # hosts that do not validate at admission (vLLM) promise here
        if not prefill and self._pull_mismatch(state):
            self._abort(state, "prompt length mismatch", report_free=False)
            state.phase = Phase.LOCAL
        return state

    def _pull_mismatch(self, state: RequestState) -> bool:
        expected = state.params.num_prompt_tokens
        if state.params.mode is not TransferMode.PULL:
            return False
        if not state.params.peer_endpoints:
            logger.warning("request %s: pull without P endpoints; recomputing", state.request_id)
            return True
        if expected is not None and expected != state.num_prompt_tokens:
            logger.warning(
                "request %s: P computed %d prompt tokens, D has %d; recomputing",
                state.request_id, expected, state.num_prompt_tokens,
            )
            return True
        return False

    def _num_remote_tokens(self, state: RequestState) -> int:
        """D: tokens whose KV comes from P. With P's first token D needs the whole prompt; without
        it D recomputes the last prompt token to sample its first token (vLLM semantics)."""
        has_token = state.params.mode is TransferMode.PUSH or state.params.first_token_id is not None
        if self.config.use_first_token and has_token:
            return state.num_prompt_tokens
        return state.num_prompt_tokens - 1

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        state = self._reqs.get(request.request_id)
        if state is None:
            params = self._params_for(request)
            if params is None:
                return 0, False
            state = self._new_state(request, params)
            self._reqs[request.request_id] = state
        if state.phase is Phase.WAITING_ALLOC:
            if self._partial_missed(state, num_computed_tokens):
                return 0, False
            total = self._num_remote_tokens(state)
            if total - num_computed_tokens <= 0:
                self._abort(state, "remote KV not needed", report_free=False)
                state.phase = Phase.LOCAL
                return 0, False
            state.num_remote_tokens = total
            state.num_local_tokens = num_computed_tokens
            return total - num_computed_tokens, True
        if state.phase in (Phase.RECV_QUEUED, Phase.RECEIVING):
            # Re-queued mid-load (preempted): the engine freed the blocks; prefill locally instead.
            logger.warning("request %s: rescheduled while loading remote KV; recomputing", request.request_id)
            self._drop_pending_recv(state)
            self._abort(state, "request preempted while loading", report_free=False)
            self._metrics.load_failures.labels(policy="recompute").inc()
            state.phase = Phase.LOCAL
        return 0, False

    def _partial_missed(self, state: RequestState, num_computed_tokens: int) -> bool:
        """D, partial transfer: P sends nothing before block ``skip_blocks``, so D must hold those
        blocks. If it evicted some since the router looked, drop the transfer and prefill locally."""
        skip = state.params.skip_blocks
        if skip <= 0:
            return False
        if num_computed_tokens >= skip * self.engine_info.block_size:
            self._metrics.partial_transfers.labels(side="recv", outcome="started").inc()
            return False
        logger.info(
            "request %s: D holds %d of the %d prefix blocks P skips; prefilling locally",
            state.request_id, num_computed_tokens // self.engine_info.block_size, skip,
        )
        self._metrics.partial_transfers.labels(side="recv", outcome="missed").inc()
        self._abort(state, "partial transfer: decode no longer holds the prefix", report_free=False)
        state.phase = Phase.LOCAL
        return True

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
        meta = KvwireConnectorMetadata(
            sends=tuple(self._sends),
            recvs=tuple(self._recvs),
            trailers=tuple(self._trailers),
            aborts=tuple(self._aborts),
            promises=self._take_promises(),
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

    # --- request end ----------------------------------------------------------------------------

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        del block_ids
        state = self._reqs.get(request.request_id)
        if state is None:
            return False, None
        if state.params.role is Role.PREFILL:
            return self._prefill_finished(state, first_output_token(request))
        return self._decode_finished(state)

    def _prefill_finished(self, state: RequestState, token: int | None) -> tuple[bool, dict[str, Any] | None]:
        if state.phase is not Phase.SENDING:
            self._reqs.pop(state.request_id, None)  # never sent (ended mid-prefill) or already acknowledged
            if state.phase is Phase.PREFILLING and state.params.mode is TransferMode.PUSH:
                # tells D at once (its lease was renewed by our promise) and drops the promise
                self._abort(state, "request ended before its KV was sent", report_free=False)
            return False, None
        state.phase = Phase.AWAITING_SEND
        now = time.monotonic()
        self._metrics.handover_seconds.labels(phase="p_prefill").observe(now - state.created_s)
        state.transfer_started_s = now
        self._metrics.blocks_awaiting_send.inc(len(state.block_ids))
        if state.params.mode is TransferMode.PUSH:
            if self.config.use_first_token:
                trailer = FirstTokenTrailer(token_id=token, num_prompt_tokens=state.num_prompt_tokens)
                self._trailers.append(TrailerSpec(state.request_id, state.params.transfer_id, trailer))
            return True, None
        if token is None:  # ended before sampling: nobody can use the leased KV
            self._abort(state, "request ended before its first token", report_free=True)
            return True, None
        params = KVTransferParams(
            transfer_id=state.params.transfer_id,
            mode=TransferMode.PULL,
            role=Role.DECODE,
            peer_endpoints=list(self.kv_endpoints),
            peer_instance_id=self.instance_id,
            deadline_s=state.deadline_s,
            first_token_id=token,
            num_prompt_tokens=state.num_prompt_tokens,
            peer_kv_layout=self.kv_layout,
        )
        return True, params.to_dict()

    def _decode_finished(self, state: RequestState) -> tuple[bool, dict[str, Any] | None]:
        if state.phase is Phase.RECEIVING:
            self._abort(state, "request ended while loading remote KV", report_free=True)
            state.phase = Phase.ABORTING
            return True, None
        if state.phase is Phase.ABORTING:
            return True, None
        if state.phase in (Phase.WAITING_ALLOC, Phase.RECV_QUEUED):
            self._drop_pending_recv(state)
            self._abort(state, "request ended before loading remote KV", report_free=False)
        del self._reqs[state.request_id]
        return False, None

    # --- helpers --------------------------------------------------------------------------------

    def _take_promises(self) -> tuple[PromiseSpec, ...]:
        with self._promises_lock:
            promises, self._promises = tuple(self._promises), []
        return promises

    def _abort(self, state: RequestState, reason: str, *, report_free: bool) -> None:
        self._aborts.append(AbortSpec(state.request_id, state.params.transfer_id, reason, report_free))

    def _drop_pending_recv(self, state: RequestState) -> None:
        self._recvs = [r for r in self._recvs if r.request_id != state.request_id]

    @property
    def num_tracked_requests(self) -> int:
        """Requests with connector state (0 once everything finished and was freed)."""
        return len(self._reqs)

    def close(self) -> None:
        self._reqs.clear()
        self._sends, self._recvs, self._trailers, self._aborts = [], [], [], []
