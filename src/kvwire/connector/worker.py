"""Worker half of the kvwire P/D connector: drives one transfer agent for one worker rank.

Called on the model-runner thread. The connector registers the engine's KV caches with the agent
once and then hands it block ids, never gathered copies (the serving path is the agent's fastest
per plane: byte spans of the blocks on TCP, device gathers/scatters on NCCL; see
:mod:`kvwire.transfer.paged_kv`). Safety of in-place transfers: P's blocks stay allocated until the
agent reports the send finished or failed; D's blocks are reused only after the agent reported the
receive, or after ``abort`` returned — from then on nothing of that transfer writes into them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import torch

from kvwire.connector.base import ConnectorMetadata, ConnectorOutput, WorkerConnector
from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
from kvwire.connector.messages import FirstTokenTrailer, decode_trailer, encode_trailer
from kvwire.connector.metadata import AbortSpec, KvwireConnectorMetadata, RecvSpec, SendSpec, TrailerSpec
from kvwire.connector.metrics import ConnectorMetrics, connector_metrics
from kvwire.connector.state import reason_label
from kvwire.errors import KvwireError
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.paged import block_ids_tensor, gather_blocks, gathered_shape, scatter_blocks
from kvwire.transfer.paged_kv import BlockTarget
from kvwire.transfer.types import LayerSpec, TransferEvents, TransferTiming

logger = logging.getLogger(__name__)


class AgentLike(Protocol):
    """The part of :class:`kvwire.transfer.TransferAgent` the connector uses."""

    @property
    def endpoint(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    def start_send(
        self, transfer_id: str, peer_endpoint: str | None, layers: Sequence[LayerSpec], *,
        deadline_s: float | None = None, with_trailer: bool = False, pull_by: str | None = None,
    ) -> None: ...

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> None: ...

    def send_blocks(
        self, transfer_id: str, layer_index: int, block_ids: torch.Tensor, ready_event: Any | None = None
    ) -> None: ...

    def send_trailer(self, transfer_id: str, payload: bytes) -> None: ...

    def expect(
        self, transfer_id: str, *, num_layers: int, deadline_s: float | None = None,
        pull_from: str | None = None, into_blocks: BlockTarget | None = None,
        accept_from: str | None = None,
    ) -> None: ...

    def take_trailer(self, transfer_id: str) -> bytes | None: ...

    def abort(self, transfer_id: str, reason: str = "aborted") -> None: ...

    def poll(self) -> TransferEvents: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class _Send:
    spec: SendSpec
    ids: torch.Tensor  # on the caches' device
    layer_bytes: list[int]  # payload bytes per layer
    num_layers_sent: int = 0
    failed: bool = False
    kv_ready_unix_s: float | None = None  # wall clock when the last layer was handed over


@dataclasses.dataclass
class _Recv:
    spec: RecvSpec


@dataclasses.dataclass
class _StepOutput:
    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)
    first_token_ids: dict[str, int] = dataclasses.field(default_factory=dict)


class KvwireWorkerConnector(WorkerConnector):
    """See the module docstring. Closes the agent on :meth:`close` when ``owns_agent``."""

    def __init__(
        self,
        config: ConnectorConfig,
        engine_info: EngineInfo,
        agent: AgentLike,
        *,
        metrics: ConnectorMetrics | None = None,
        owns_agent: bool = True,
    ) -> None:
        self.config = config
        self.engine_info = engine_info
        self.agent = agent
        self._owns_agent = owns_agent
        self._metrics = metrics if metrics is not None else connector_metrics()
        self._layout = KVLayout(engine_info.kv_layout)
        self._kv_caches: list[torch.Tensor] = []
        self._sends: dict[str, _Send] = {}  # transfer id -> live send
        self._recvs: dict[str, _Recv] = {}  # transfer id -> live receive
        self._saving: list[_Send] = []  # sends whose layers this step's forward hands over
        self._pending = _StepOutput()  # local outcomes reported by the next get_finished
        self._closed = False
        self._metadata = None

    @property
    def kv_endpoint(self) -> str:
        return self.agent.endpoint

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches)
        self._preload_kernels()
        if self._kv_caches:
            self.agent.register_kv_caches(self._kv_caches, self._layout)

    def _preload_kernels(self) -> None:
        """Gather block 0 of one layer per dtype and scatter it back onto itself (same bytes, same
        stream, before any request), so the gather/scatter kernels are loaded now. With CUDA's lazy
        module loading a kernel's first launch loads its module, which synchronizes the context; on a
        transfer thread, with NCCL receives pending on this GPU for data the peer sends only after our
        next grant, that wait never ends (docs/decisions/062-nccl-device-consumers.md)."""
        seen: set[torch.dtype] = set()
        for cache in self._kv_caches:
            if cache.dtype in seen or cache.numel() == 0:
                continue
            seen.add(cache.dtype)
            ids = torch.zeros(1, dtype=torch.int64, device=cache.device)
            scatter_blocks(cache, ids, gather_blocks(cache, ids, self._layout), self._layout)
        if self._kv_caches and self._kv_caches[0].is_cuda:
            torch.cuda.current_stream(self._kv_caches[0].device).synchronize()

    # --- per step ---------------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if not isinstance(metadata, KvwireConnectorMetadata):
            return
        for abort in metadata.aborts:
            self._apply_abort(abort)
        for recv in metadata.recvs:
            self._expect(recv)
        for send in metadata.sends:
            self._announce(send)
        for trailer in metadata.trailers:
            self._send_trailer(trailer)

    def clear_connector_metadata(self) -> None:
        self._finish_saves()
        super().clear_connector_metadata()

    def start_load_kv(self) -> None:
        """Loads were started at bind time (asynchronous: the requests wait in the scheduler)."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Nothing to wait for: requests resume only once all their layers are in."""
        del layer_index

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        """The forward wrote layer ``layer_index``'s KV (``kv_layer`` is that registered cache):
        hand its blocks of every finishing prefill to the agent, ordered after the write on a GPU."""
        del kv_layer  # the agent reads the registered cache itself
        event = None
        for send in self._saving:
            if send.failed:
                continue
            if event is None and send.ids.is_cuda:
                event = torch.cuda.Event()
                event.record()
            try:
                self.agent.send_blocks(send.spec.transfer_id, layer_index, send.ids, event)
            except KvwireError as exc:
                logger.warning("transfer %s: send_blocks failed: %s", send.spec.transfer_id, exc)
                send.failed = True
                continue
            send.num_layers_sent += 1
            if send.num_layers_sent == len(self._kv_caches):
                send.kv_ready_unix_s = time.time()
            self._metrics.send_bytes.inc(send.layer_bytes[layer_index])

    def wait_for_save(self) -> None:
        self._finish_saves()

    def get_finished(self, finished_req_ids: set[str]) -> ConnectorOutput:
        del finished_req_ids  # aborts arrive as AbortSpecs in the metadata
        out, self._pending = self._pending, _StepOutput()
        events = self.agent.poll()
        for tid in events.finished_sending:
            self._on_sent(tid, out, events.timings.get(tid))
        for tid in events.finished_recving:
            self._on_received(tid, out, events.timings.get(tid))
        for tid, reason in events.failed.items():
            self._on_failed(tid, reason, out)
        return ConnectorOutput(
            finished_sending=frozenset(out.finished_sending),
            finished_recving=frozenset(out.finished_recving),
            failed=out.failed,
            invalid_block_ids=frozenset(out.invalid_block_ids),
            first_token_ids=out.first_token_ids,
        )

    # --- send side --------------------------------------------------------------------------

    def _announce(self, spec: SendSpec) -> None:
        peer: str | None = None
        if spec.peer_endpoints:
            if self.engine_info.rank >= len(spec.peer_endpoints):
                self._pending.finished_sending.add(spec.request_id)
                self._count_failure("send", "mismatch: no endpoint for this rank")
                return
            peer = spec.peer_endpoints[self.engine_info.rank]
        rank = self.engine_info.rank
        pull_by = spec.pull_by[rank] if rank < len(spec.pull_by) else None
        layers = [
            LayerSpec(gathered_shape(cache, len(spec.block_ids), self._layout), cache.dtype)
            for cache in self._kv_caches
        ]
        send = _Send(spec, self._ids(spec.block_ids), [layer.num_bytes for layer in layers])
        try:
            self.agent.start_send(
                spec.transfer_id, peer, layers, deadline_s=spec.deadline_s, with_trailer=spec.with_trailer,
                pull_by=pull_by,
            )
        except KvwireError as exc:
            logger.warning("transfer %s: start_send failed: %s", spec.transfer_id, exc)
            self._pending.finished_sending.add(spec.request_id)
            self._count_failure("send", str(exc))
            return
        self._metrics.transfers_started.labels(side="send").inc()
        self._sends[spec.transfer_id] = send
        self._saving.append(send)

    def _finish_saves(self) -> None:
        """After the forward: a send that did not get every KV layer can never complete; fail it now
        rather than at its deadline."""
        for send in self._saving:
            if send.num_layers_sent < len(self._kv_caches) and send.spec.transfer_id in self._sends:
                reason = f"mismatch: {send.num_layers_sent} of {len(self._kv_caches)} layers saved"
                self._abort_agent(send.spec.transfer_id, reason)
        self._saving = []

    def _send_trailer(self, spec: TrailerSpec) -> None:
        send = self._sends.get(spec.transfer_id)
        if send is None:
            return  # already failed or aborted
        trailer = msgspec.structs.replace(spec.first_token, kv_ready_unix_s=send.kv_ready_unix_s)
        try:
            self.agent.send_trailer(spec.transfer_id, encode_trailer(trailer))
        except KvwireError as exc:
            logger.warning("transfer %s: send_trailer failed: %s", spec.transfer_id, exc)

    def _on_sent(self, tid: str, out: _StepOutput, timing: TransferTiming | None) -> None:
        send = self._sends.pop(tid, None)
        if send is not None:
            self._metrics.transfers_completed.labels(side="send").inc()
            out.finished_sending.add(send.spec.request_id)
        if timing is not None:
            self._metrics.observe_transfer("send", timing)

    # --- receive side -----------------------------------------------------------------------

    def _expect(self, spec: RecvSpec) -> None:
        recv = _Recv(spec)
        pull_from: str | None = None
        if spec.pull_from:
            if self.engine_info.rank >= len(spec.pull_from):
                self._recv_failed(recv, "mismatch: no P endpoint for this rank", self._pending)
                return
            pull_from = spec.pull_from[self.engine_info.rank]
        rank = self.engine_info.rank
        accept_from = spec.sender_endpoints[rank] if rank < len(spec.sender_endpoints) else None
        self._recvs[spec.transfer_id] = recv
        # P's payload starts at D's block ``first_block`` (a partial transfer: P skips the prefix the
        # router said D holds); D writes from ``skip_blocks`` on (what it holds itself now)
        target = BlockTarget(tuple(spec.block_ids[spec.skip_blocks :]), spec.skip_blocks - spec.first_block)
        try:
            self.agent.expect(
                spec.transfer_id, num_layers=len(self._kv_caches), into_blocks=target,
                deadline_s=spec.deadline_s, pull_from=pull_from, accept_from=accept_from,
            )
        except KvwireError as exc:
            del self._recvs[spec.transfer_id]
            self._recv_failed(recv, str(exc), self._pending)
            return
        self._metrics.transfers_started.labels(side="recv").inc()

    def _on_received(self, tid: str, out: _StepOutput, timing: TransferTiming | None) -> None:
        recv = self._recvs.pop(tid, None)
        if recv is None:
            return
        self._metrics.transfers_completed.labels(side="recv").inc()
        if timing is not None:
            self._metrics.recv_bytes.inc(timing.num_bytes)
            self._metrics.observe_transfer("recv", timing)
        out.finished_recving.add(recv.spec.request_id)
        if recv.spec.want_trailer:
            trailer = self._read_trailer(tid)
            if trailer is not None and trailer.token_id is not None:
                out.first_token_ids[recv.spec.request_id] = trailer.token_id
                if trailer.kv_ready_unix_s is not None:  # P's last layer computed -> D can decode
                    exposed = max(time.time() - trailer.kv_ready_unix_s, 0.0)
                    self._metrics.handover_seconds.labels(phase="exposed").observe(exposed)

    def _read_trailer(self, tid: str) -> FirstTokenTrailer | None:
        try:
            payload = self.agent.take_trailer(tid)
            return None if payload is None else decode_trailer(payload)
        except KvwireError as exc:
            logger.warning("transfer %s: no usable first token (%s); recomputing it", tid, exc)
            return None

    def _recv_failed(self, recv: _Recv, reason: str, out: _StepOutput) -> None:
        """Apply the load-failure policy: recompute (report the blocks invalid) or fail the request."""
        self._count_failure("recv", reason)
        request_id = recv.spec.request_id
        if self.config.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE:
            logger.warning("request %s: remote KV load failed (%s); recomputing", request_id, reason)
            out.finished_recving.add(request_id)
            out.invalid_block_ids.update(recv.spec.block_ids)
        else:
            logger.warning("request %s: remote KV load failed (%s); failing it", request_id, reason)
            out.failed[request_id] = f"remote KV load failed: {reason}"

    # --- both sides -------------------------------------------------------------------------

    def _on_failed(self, tid: str, reason: str, out: _StepOutput) -> None:
        send = self._sends.pop(tid, None)
        if send is not None:
            self._count_failure("send", reason)
            out.finished_sending.add(send.spec.request_id)  # P's blocks may be freed
        recv = self._recvs.pop(tid, None)
        if recv is not None:
            self._recv_failed(recv, reason, out)

    def _apply_abort(self, spec: AbortSpec) -> None:
        recv = self._recvs.pop(spec.transfer_id, None)
        send = self._sends.pop(spec.transfer_id, None)
        if recv is not None:
            self._count_failure("recv", "aborted")
        if send is not None:
            self._saving = [s for s in self._saving if s is not send]
            self._count_failure("send", "aborted")
        self._abort_agent(spec.transfer_id, spec.reason)
        if spec.report_free:
            self._pending.finished_sending.add(spec.request_id)

    def _abort_agent(self, tid: str, reason: str) -> None:
        try:
            self.agent.abort(tid, reason)
        except KvwireError as exc:
            logger.debug("transfer %s: abort: %s", tid, exc)

    def _count_failure(self, side: str, reason: str) -> None:
        self._metrics.transfers_failed.labels(side=side, reason=reason_label(reason)).inc()

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        device = self._kv_caches[0].device if self._kv_caches else torch.device(self.engine_info.device)
        return block_ids_tensor(block_ids, device)

    @property
    def num_live_transfers(self) -> int:
        return len(self._sends) + len(self._recvs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sends.clear()
        self._recvs.clear()
        self._saving = []
        if self._owns_agent:
            self.agent.close()
