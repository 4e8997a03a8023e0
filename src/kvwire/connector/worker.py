"""Worker half of the kvwire P/D connector: drives one transfer agent for one worker rank.

Called on the model-runner thread, except the receive sinks, which run on the agent's transfer
threads: each receive has a lock and a ``cancelled`` flag, so once a receive is cancelled (abort,
failure) no scatter into its blocks is running or can start, and the engine may reuse them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvwire.connector.base import ConnectorMetadata, ConnectorOutput, WorkerConnector
from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
from kvwire.connector.messages import decode_trailer
from kvwire.connector.metadata import (
    AbortSpec,
    KvwireConnectorMetadata,
    PromiseSpec,
    RecvSpec,
    SendSpec,
    TrailerSpec,
)
from kvwire.connector.metrics import ConnectorMetrics, connector_metrics
from kvwire.connector.state import reason_label
from kvwire.errors import KvwireError
from kvwire.transfer.paged import KVLayout, block_ids_tensor, gather_blocks, gathered_shape, scatter_blocks
from kvwire.transfer.types import LayerSink, LayerSpec, TransferEvents

logger = logging.getLogger(__name__)

_BLOCK_DIM = {KVLayout.KV_FIRST: 1, KVLayout.BLOCK_FIRST: 0, KVLayout.MLA: 0}


class AgentLike(Protocol):
    """The part of :class:`kvwire.transfer.TransferAgent` the connector uses."""

    @property
    def endpoint(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    def start_send(
        self, transfer_id: str, peer_endpoint: str | None, layers: Sequence[LayerSpec], *,
        deadline_s: float | None = None, with_trailer: bool = False, limit_s: float | None = None,
    ) -> None: ...

    def send_layer(
        self, transfer_id: str, layer_index: int, tensor: torch.Tensor, ready_event: Any | None = None
    ) -> None: ...

    def send_trailer(self, transfer_id: str, payload: bytes) -> None: ...

    def promise(
        self, transfer_id: str, peer_endpoint: str, *, deadline_s: float | None = None,
        limit_s: float | None = None,
    ) -> None: ...

    def expect(
        self, transfer_id: str, *, num_layers: int, sink: LayerSink | None = None,
        deadline_s: float | None = None, pull_from: str | None = None,
        sender: str | None = None, limit_s: float | None = None,
    ) -> None: ...

    def take_trailer(self, transfer_id: str) -> bytes | None: ...

    def abort(self, transfer_id: str, reason: str = "aborted") -> None: ...

    def poll(self) -> TransferEvents: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class _Send:
    spec: SendSpec
    ids: torch.Tensor
    num_layers_sent: int = 0
    failed: bool = False


@dataclasses.dataclass
class _Recv:
    spec: RecvSpec
    ids: torch.Tensor  # host memory (see _expect)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    cancelled: bool = False
    error: str | None = None  # a layer could not be scattered (shape/dtype mismatch)


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
        stats = getattr(agent, "stats", None)
        if callable(stats):  # a real agent (test fakes have no stats)
            self._metrics.control_rejected.set_function(lambda: float(stats().messages_rejected))
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
        for promise in metadata.promises:
            self._promise(promise)
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
        for send in self._saving:
            if send.failed:
                continue
            data = gather_blocks(kv_layer, send.ids, self._layout)  # [.., num_blocks, ..] contiguous
            event = None
            if data.is_cuda:
                event = torch.cuda.Event()
                event.record()
            try:
                self.agent.send_layer(send.spec.transfer_id, layer_index, data, event)
            except KvwireError as exc:
                logger.warning("transfer %s: send_layer failed: %s", send.spec.transfer_id, exc)
                send.failed = True
                continue
            send.num_layers_sent += 1
            self._metrics.send_bytes.inc(data.numel() * data.element_size())

    def wait_for_save(self) -> None:
        self._finish_saves()

    def get_finished(self, finished_req_ids: set[str]) -> ConnectorOutput:
        del finished_req_ids  # aborts arrive as AbortSpecs in the metadata
        out, self._pending = self._pending, _StepOutput()
        events = self.agent.poll()
        for tid in events.finished_sending:
            self._on_sent(tid, out)
        for tid in events.finished_recving:
            self._on_received(tid, out)
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
        send = _Send(spec, self._ids(spec.block_ids))
        layers = [
            LayerSpec(gathered_shape(cache, len(spec.block_ids), self._layout), cache.dtype)
            for cache in self._kv_caches
        ]
        try:
            self.agent.start_send(
                spec.transfer_id, peer, layers, deadline_s=spec.deadline_s,
                with_trailer=spec.with_trailer, limit_s=spec.limit_s,
            )
        except KvwireError as exc:
            logger.warning("transfer %s: start_send failed: %s", spec.transfer_id, exc)
            self._pending.finished_sending.add(spec.request_id)
            self._count_failure("send", str(exc))
            return
        self._metrics.transfers_started.labels(side="send").inc()
        self._sends[spec.transfer_id] = send
        self._saving.append(send)

    def _promise(self, spec: PromiseSpec) -> None:
        rank = self.engine_info.rank
        if rank >= len(spec.peer_endpoints):
            return
        try:
            self.agent.promise(spec.transfer_id, spec.peer_endpoints[rank], deadline_s=spec.deadline_s,
                               limit_s=spec.limit_s)
        except KvwireError as exc:
            logger.warning("transfer %s: promise failed: %s", spec.transfer_id, exc)

    def _finish_saves(self) -> None:
        """After the forward: a send that did not get every KV layer can never complete; fail it now
        rather than at its deadline."""
        for send in self._saving:
            if send.num_layers_sent < len(self._kv_caches) and send.spec.transfer_id in self._sends:
                reason = f"mismatch: {send.num_layers_sent} of {len(self._kv_caches)} layers saved"
                self._abort_agent(send.spec.transfer_id, reason)
        self._saving = []

    def _send_trailer(self, spec: TrailerSpec) -> None:
        if spec.transfer_id not in self._sends:
            return  # already failed or aborted
        try:
            self.agent.send_trailer(spec.transfer_id, spec.payload)
        except KvwireError as exc:
            logger.warning("transfer %s: send_trailer failed: %s", spec.transfer_id, exc)

    def _on_sent(self, tid: str, out: _StepOutput) -> None:
        send = self._sends.pop(tid, None)
        if send is not None:
            self._metrics.transfers_completed.labels(side="send").inc()
            out.finished_sending.add(send.spec.request_id)

    # --- receive side -----------------------------------------------------------------------

    def _expect(self, spec: RecvSpec) -> None:
        # Host-side ids: the sink copies them on its own (delivery) stream, so the copy is ordered
        # before the scatter whatever stream the engine thread had current here.
        recv = _Recv(spec, self._host_ids(spec.block_ids[spec.skip_blocks :]))
        pull_from: str | None = None
        if spec.pull_from:
            if self.engine_info.rank >= len(spec.pull_from):
                self._recv_failed(recv, "mismatch: no P endpoint for this rank", self._pending)
                return
            pull_from = spec.pull_from[self.engine_info.rank]
        rank = self.engine_info.rank
        sender = spec.sender_endpoints[rank] if rank < len(spec.sender_endpoints) else None
        self._recvs[spec.transfer_id] = recv
        sink: LayerSink = lambda index, tensor: self._sink(recv, index, tensor)  # noqa: E731
        try:
            self.agent.expect(
                spec.transfer_id, num_layers=len(self._kv_caches), sink=sink,
                deadline_s=spec.deadline_s, pull_from=pull_from, sender=sender, limit_s=spec.limit_s,
            )
        except KvwireError as exc:
            del self._recvs[spec.transfer_id]
            self._recv_failed(recv, str(exc), self._pending)
            return
        self._metrics.transfers_started.labels(side="recv").inc()

    def _sink(self, recv: _Recv, layer_index: int, tensor: torch.Tensor) -> None:
        """Transfer thread: scatter one arrived layer into the request's blocks."""
        with recv.lock:
            if recv.cancelled or recv.error is not None:
                return
            try:
                cache = self._kv_caches[layer_index]
                data = self._fit(tensor, len(recv.spec.block_ids), recv.spec.skip_blocks)
                ids = recv.ids if cache.device.type == "cpu" else recv.ids.to(cache.device, non_blocking=True)
                scatter_blocks(cache, ids, data, self._layout)
            except (IndexError, ValueError) as exc:
                recv.error = f"mismatch: layer {layer_index}: {exc}"
                return
        self._metrics.recv_bytes.inc(tensor.numel() * tensor.element_size())

    def _fit(self, data: torch.Tensor, num_blocks: int, skip_blocks: int) -> torch.Tensor:
        """The part of P's payload D writes: P sends the whole prompt's blocks; D may load fewer (it
        recomputes the last prompt token) and skips the blocks it already had."""
        dim = _BLOCK_DIM[self._layout]
        if data.dim() <= dim:
            return data
        end = min(num_blocks, int(data.shape[dim]))
        return data.narrow(dim, skip_blocks, max(end - skip_blocks, 0))

    def _on_received(self, tid: str, out: _StepOutput) -> None:
        recv = self._recvs.pop(tid, None)
        if recv is None:
            return
        with recv.lock:
            recv.cancelled = True
        if recv.error is not None:
            self._abort_agent(tid, recv.error)
            self._recv_failed(recv, recv.error, out)
            return
        self._metrics.transfers_completed.labels(side="recv").inc()
        out.finished_recving.add(recv.spec.request_id)
        if recv.spec.want_trailer:
            token = self._read_trailer(tid)
            if token is not None:
                out.first_token_ids[recv.spec.request_id] = token

    def _read_trailer(self, tid: str) -> int | None:
        try:
            payload = self.agent.take_trailer(tid)
            return None if payload is None else decode_trailer(payload).token_id
        except KvwireError as exc:
            logger.warning("transfer %s: no usable first token (%s); recomputing it", tid, exc)
            return None

    def _recv_failed(self, recv: _Recv, reason: str, out: _StepOutput) -> None:
        """Apply the load-failure policy: recompute (report the blocks invalid) or fail the request."""
        with recv.lock:
            recv.cancelled = True
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
            with recv.lock:
                recv.cancelled = True
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

    def _host_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """int64 ids in host memory (pinned when the cache is on a GPU, for asynchronous copies)."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        if self._kv_caches and self._kv_caches[0].is_cuda:
            ids = ids.pin_memory()
        return ids

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
        for recv in self._recvs.values():
            with recv.lock:
                recv.cancelled = True
        self._sends.clear()
        self._recvs.clear()
        self._saving = []
        if self._owns_agent:
            self.agent.close()
