"""The scheduler connector's per-request hooks (engine thread, except ``check_request_params``):
validate a request's ``kv_transfer_params`` as it arrives, say how many of its tokens come from the
peer when it is admitted, and decide its blocks' fate when it ends (``request_finished``: kept until
the send is acknowledged, or freed). :class:`RequestHooks` also owns the connector's state; the
per-step half (plan, report) is :class:`kvwire.connector.scheduler.KvwireSchedulerConnector`, which
the hosts use. Split so that each half is entered in one place on a request's path (decision 144).
"""


from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvwire.connector.base import (
    ConnectorRequest,
)
from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.first_token_trailer import FirstTokenTrailer
from kvwire.connector.metadata import (
    AbortSpec,
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


class RequestHooks:
    """The per-request half of :class:`~kvwire.connector.scheduler.KvwireSchedulerConnector` (see the
    module docstring); the state both halves share is made here."""

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
        # Admissions withdrawn before the engine took them (any thread: under the promises' lock);
        # ``withdraw_now``, set like ``promise_now``, ends the promise at once on the admission thread.
        self._withdrawn: list[AbortSpec] = []
        self.withdraw_now: Callable[[AbortSpec], None] | None = None

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

    def withdraw_request_params(self, params: KVTransferParams, reason: str) -> None:
        """Any thread: a request whose params passed :meth:`check_request_params` never reached the
        engine (refused there, the server shutting down, its client gone first). P's promise for it
        ends as an abort ends it: D is told at once and stops waiting for a send that cannot come (the
        promise would renew D's lease up to its limit). Idempotent."""
        push_from_p = params.role is Role.PREFILL and params.mode is TransferMode.PUSH
        if not push_from_p or not params.peer_endpoints:
            return
        spec = AbortSpec("", params.transfer_id, reason, report_free=False)
        with self._promises_lock:
            self._promises = [p for p in self._promises if p.transfer_id != params.transfer_id]
            self._withdrawn.append(spec)
        if self.withdraw_now is not None:
            self.withdraw_now(spec)

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

    def _abort(self, state: RequestState, reason: str, *, report_free: bool) -> None:
        self._aborts.append(AbortSpec(state.request_id, state.params.transfer_id, reason, report_free))

    def _drop_pending_recv(self, state: RequestState) -> None:
        self._recvs = [r for r in self._recvs if r.request_id != state.request_id]
