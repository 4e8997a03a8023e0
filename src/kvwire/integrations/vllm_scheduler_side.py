"""Scheduler half of the vLLM plugin: vLLM's scheduler calls -> the connector core (no vLLM import).

Lives in vLLM's engine-core process, called on the scheduler thread only. The core scheduler half
needs every rank's transfer-agent endpoint, which exists only once the workers started their agents:
vLLM delivers them after the scheduler is built, through its handshake-metadata hook
(:meth:`SchedulerSide.set_endpoints`), before the first request is scheduled. The same moment starts
the router registration (:class:`kvwire.discovery.HeartbeatClient`), with the endpoints per rank and a
load snapshot refreshed every scheduler step. When vLLM publishes its own KV events
(``--kv-events-config``) and the router is reached over ZeroMQ, a bridge thread forwards them with the
heartbeats, re-hashed as kvwire hashes (:mod:`kvwire.integrations.vllm_kv_events`, decision 100).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvwire.connector.base import ConnectorOutput, ConnectorRequest
from kvwire.connector.config import EngineInfo
from kvwire.connector.metadata import KvwireConnectorMetadata
from kvwire.connector.metrics import connector_metrics
from kvwire.connector.scheduler import KvwireSchedulerConnector
from kvwire.discovery import InstanceLoad, Registration, start_registration
from kvwire.discovery.address import DiscoveryKind, parse_registration_address
from kvwire.errors import EngineError, InvalidRequestError
from kvwire.http.refusal_log import RefusalLog
from kvwire.integrations.vllm_config import VllmPluginConfig
from kvwire.integrations.vllm_kv_events import VllmKvEventBridge, VllmKvEventsSource, VllmKvTranslator
from kvwire.integrations.vllm_steps import DeliveryLedger, StepTracker
from kvwire.protocol.kv_blocks import KvEventLog
from kvwire.protocol.kv_params import KVTransferParams
from kvwire.protocol.kv_signing import KVParamsRefused, verifier_from_secret
from kvwire.supervision import HealthBoard

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class RankEndpoint:
    """What one worker rank tells the scheduler half (vLLM's handshake metadata)."""

    rank: int
    endpoint: str  # the rank's transfer-agent control endpoint
    instance_id: str  # the agent's per-process id (epoch)


@dataclasses.dataclass(frozen=True)
class Identity:
    """How the instance presents itself to the router."""

    instance_id: str
    model_name: str
    version: str
    tokenizer: str = ""  # a local model directory the router can tokenize with (InstanceInfo.tokenizer)


class SchedulerSide:
    """See the module docstring."""

    def __init__(
        self, config: VllmPluginConfig, engine_info: EngineInfo, identity: Identity,
        kv_events: VllmKvEventsSource | None = None,
    ) -> None:
        self.config = config
        self.engine_info = engine_info
        self.identity = identity
        self._core: KvwireSchedulerConnector | None = None
        self._tracker = StepTracker()
        self._ledger = DeliveryLedger()
        self._heartbeat: Registration | None = None
        self._block_pool: Any = None
        self._num_inflight = 0
        self._load = InstanceLoad()
        self._closed = False
        # The registration and KV-event threads run supervised on this board; vLLM's health check
        # cannot read it, so a dead one is logged as an error (once) at the next scheduler step.
        self.board = HealthBoard()
        self._reported_dead: set[str] = set()
        # With a shared secret, kv_transfer_params must be router-signed (kvwire.protocol.kv_signing); a
        # request whose params are refused runs locally: no transfer, no connection to any peer.
        self._verifier = verifier_from_secret(config.secret)
        self._judged: dict[str, bool] = {}  # request id -> params accepted (until request_finished)
        self._refusals = RefusalLog(logger, "kv_transfer_params")
        self.kv_event_log: KvEventLog | None = None
        self.kv_bridge: VllmKvEventBridge | None = None
        self._start_kv_events(kv_events)

    def _start_kv_events(self, source: VllmKvEventsSource | None) -> None:
        """Subscribe to vLLM's KV event publisher now (before any request), if the router can get them."""
        address = self.config.router_address
        if address is None:
            return
        if source is None:
            logger.info("kvwire: vLLM publishes no KV events (--kv-events-config); the router routes "
                        "this instance on load only")
            return
        if parse_registration_address(address).kind is not DiscoveryKind.ZMQ:
            logger.info("kvwire: KV events travel on ZeroMQ discovery only; %s is routed on load", address)
            return
        self.kv_event_log = KvEventLog(self.engine_info.block_size)
        self.kv_bridge = VllmKvEventBridge(
            source.endpoint, VllmKvTranslator(self.kv_event_log), source.topic, board=self.board
        ).start()

    # --- start-up -------------------------------------------------------------------------------

    def bind_block_pool(self, block_pool: Any) -> None:
        """vLLM's block pool (``get_num_free_blocks()``, ``num_gpu_blocks``), read on this thread."""
        self._block_pool = block_pool

    def set_endpoints(self, ranks: Sequence[RankEndpoint]) -> None:
        """All workers' endpoints (one per TP rank 0..n-1): builds the core and starts registration."""
        by_rank = {r.rank: r for r in ranks}
        if sorted(by_rank) != list(range(len(by_rank))) or not by_rank:
            raise EngineError(f"KvwireConnector: worker ranks {sorted(by_rank)} are not 0..n-1")
        ordered = [by_rank[i] for i in range(len(by_rank))]
        endpoints = [r.endpoint for r in ordered]
        self._core = KvwireSchedulerConnector(
            self.config.connector, self.engine_info, endpoints, instance_id=ordered[0].instance_id
        )
        logger.info("kvwire: %s instance, KV endpoints %s", self.config.connector.role.value, endpoints)
        if self.config.router_address is not None and self._heartbeat is None:
            self._start_heartbeat(endpoints)

    def _start_heartbeat(self, endpoints: list[str]) -> None:
        assert self.config.router_address is not None and self.config.http_url is not None
        self._heartbeat = start_registration(
            self.config.router_address, instance_id=self.identity.instance_id,
            role=self.config.connector.role,  # same values as the server's roles
            url=self.config.http_url, model=self.identity.model_name, kv_endpoints=endpoints,
            version=self.identity.version, load_fn=lambda: self._load,
            interval_s=self.config.heartbeat_interval_s, secret=self.config.secret,
            kv_events=self.kv_event_log, tokenizer=self.identity.tokenizer,
            wait_for_http=True,  # vLLM's HTTP server starts listening after engine init
            kv_mode="" if self.config.configured_mode is None else self.config.configured_mode.value,
            board=self.board,
        )

    @property
    def core(self) -> KvwireSchedulerConnector:
        if self._core is None:
            raise EngineError("KvwireConnector: scheduler used before the workers' endpoints arrived")
        return self._core

    # --- vLLM scheduler hooks -------------------------------------------------------------------

    def on_new_request(self) -> None:
        self._num_inflight += 1

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self._params_accepted(request):
            return 0, False
        return self.core.get_num_new_matched_tokens(request, num_computed_tokens)

    def _params_accepted(self, request: ConnectorRequest) -> bool:
        """False when a secret is set and the request's kv_transfer_params fail verification (judged
        once per request; malformed params are left to the core, which ignores them)."""
        if self._verifier is None or request.kv_transfer_params is None:
            return True
        accepted = self._judged.get(request.request_id)
        if accepted is not None:
            return accepted
        try:
            params = KVTransferParams.from_dict(request.kv_transfer_params)
            self._verifier.verify(params)
            accepted = True
        except InvalidRequestError:
            accepted = True
        except KVParamsRefused as exc:
            accepted = False
            connector_metrics().params_refused.labels(reason=exc.reason).inc()
            self._refusals.refused(exc.reason, f"request {request.request_id}: {exc}; running it locally")
        self._judged[request.request_id] = accepted
        return accepted

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.core.update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens > 0:  # the core promises every external token asynchronously
            self._ledger.promised_load(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KvwireConnectorMetadata:
        step = self._tracker.step_info(scheduler_output)
        self._refresh_load(len(step.scheduled))
        self._report_dead()
        return self.core.build_connector_meta(step)

    def _report_dead(self) -> None:
        """Log each dead component once (vLLM's health check cannot see this board)."""
        for status in self.board.dead():
            if status.name not in self._reported_dead:
                self._reported_dead.add(status.name)
                logger.error("kvwire: component %s is dead (%s): this instance no longer registers or "
                             "reports KV events to the router; restart it", status.name, status.last_error)

    def update_connector_output(self, output: Any) -> None:
        """Feed the workers' (aggregated) output to the core, then rewrite vLLM's completion sets in
        place: vLLM reads them right after this call (see :class:`DeliveryLedger`)."""
        sending = frozenset(output.finished_sending or ())
        recving = frozenset(output.finished_recving or ())
        self.core.update_connector_output(
            ConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=frozenset(output.invalid_block_ids or ()),
            )
        )
        output.finished_sending, output.finished_recving = self._ledger.rewrite(sending, recving)

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._num_inflight = max(0, self._num_inflight - 1)
        if not self._judged.pop(request.request_id, True):
            return False, None
        delay_free, params = self.core.request_finished(request, block_ids)
        if delay_free:
            self._ledger.delayed_free(request.request_id)
        return delay_free, params

    def has_pending_sends(self) -> bool:
        return self._ledger.has_pending_sends()

    # --- load and shutdown ----------------------------------------------------------------------

    def _refresh_load(self, num_scheduled: int) -> None:
        free = total = 0
        if self._block_pool is not None:
            free = int(self._block_pool.get_num_free_blocks())
            total = int(self._block_pool.num_gpu_blocks)
        running = min(num_scheduled, self._num_inflight)
        self._load = InstanceLoad(
            num_running=running,
            num_waiting=self._num_inflight - running,
            free_kv_blocks=free,
            total_kv_blocks=total,
        )

    @property
    def num_outstanding(self) -> int:
        """Completions vLLM still waits for (0 when every held block was released)."""
        return self._ledger.num_outstanding

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.kv_bridge is not None:
            self.kv_bridge.close()
        if self._heartbeat is not None:
            self._heartbeat.close()  # sends the deregistration
        if self._core is not None:
            self._core.close()
        logger.info("kvwire: scheduler side closed (%d completions outstanding)", self.num_outstanding)


def rank_endpoints(handshakes: Mapping[int, Any]) -> list[RankEndpoint]:
    """vLLM's ``{tp_rank: handshake}`` -> rank endpoints (handshake: ``endpoint``/``instance_id``)."""
    return [RankEndpoint(rank, h.endpoint, h.instance_id) for rank, h in handshakes.items()]
