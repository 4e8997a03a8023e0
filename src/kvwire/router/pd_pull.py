"""P/D pull: D picked first and named in P's params (P leases its KV to that D only, decision 044);
P is called first; the ``kv_transfer_params`` P returns go to D with the role switched to decode.

Each of the two calls is retried on another instance when its instance refused the connection (the
request surely never arrived), up to ``max_connect_retries``; a D retry re-picks D, which P then
refuses to serve its pull, so that D recomputes the prompt. Event-loop thread; calls nothing back.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from kvwire.protocol.kv_params import Role
from kvwire.router.config import RouterConfig
from kvwire.router.metrics import RouterMetrics
from kvwire.router.pd_bodies import decode_body, prefill_body
from kvwire.router.pd_params import PdParams
from kvwire.router.registry import InstanceView
from kvwire.router.relay import Relay
from kvwire.router.request import ClientRequest
from kvwire.router.selection import Selector
from kvwire.router.upstream import UpstreamFailure

T = TypeVar("T")


class PullPath:
    def __init__(
        self, cfg: RouterConfig, selector: Selector, relay: Relay, params: PdParams, metrics: RouterMetrics
    ) -> None:
        self._cfg = cfg
        self._selector = selector
        self._relay = relay
        self._params = params
        self._metrics = metrics

    async def serve(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        tid = uuid.uuid4().hex
        # D is picked first and named in P's params: P leases its KV to that D only (decision 044).
        d = self._selector.pick(Role.DECODE, creq.model)
        model = creq.model or d.info.model  # P must serve the model D decodes
        p_body = prefill_body(creq, self._params.pull_prefill(tid, d))
        p, answer = await self._retrying(lambda: self._prefill_only(creq, p_body, model))
        d_body = decode_body(creq, self._params.pull_decode(p, answer))
        picked = [d]  # a retry re-picks; P refuses that D's pull and it recomputes the prompt
        return await self._retrying(lambda: self._relay.single(
            request, creq, Role.DECODE, d_body, model, inst=picked.pop() if picked else None))

    async def _prefill_only(self, creq: ClientRequest, body: bytes, model: str | None
                            ) -> tuple[InstanceView, bytes]:
        p = self._selector.pick(Role.PREFILL, model)
        with self._selector.track(p.instance_id, creq.est_prompt_tokens):
            _, data = await self._relay.call(p, "prefill", creq, body, stream=False)
        return p, data

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt``, again while its instance refuses the connection (``max_connect_retries``)."""
        for i in range(self._cfg.max_connect_retries + 1):
            try:
                return await attempt()
            except UpstreamFailure as exc:
                if not exc.retryable or i == self._cfg.max_connect_retries:
                    raise
                self._metrics.retries.inc()
        raise AssertionError("unreachable")
