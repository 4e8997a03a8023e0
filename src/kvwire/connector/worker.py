"""Worker half of the kvwire P/D connector: drives one transfer agent for one worker rank.

Called on the model-runner thread. The connector registers the engine's KV caches with the agent
once and then hands it block ids, never gathered copies (the serving path is the agent's fastest
per plane: byte spans of the blocks on TCP, device gathers/scatters on NCCL; see
:mod:`kvwire.transfer.memory`). Safety of in-place transfers: P's blocks stay allocated until the
agent reports the send finished or failed; D's blocks are reused only after the agent reported the
receive, or after the receive failed or was aborted and no sender may still write into them (a
stalled shared-memory sender: the outcome waits in :mod:`kvwire.connector.quarantine`).

P and D of different tensor-parallel sizes exchange *pieces* (one per pair of ranks, a head range
each; :mod:`kvwire.connector.pieces`): a request is done on this rank when every piece is.

Three classes: :class:`KvwireWorkerConnector`, the face the engine and the vLLM plugin call (the
per-step hooks, the report, what both sides share and what spans them: a failed piece, an abort);
``_SendSide``, P's pieces (promises, the layers the forward hands over, the deferred start of a push
from CPU caches, the trailer); ``_ReceiveSide``, D's pieces (expects, trailers, the load-failure
policy, the quarantine). The sides live in the connector and call back into it for shared work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import torch

from kvwire.connector.base import ConnectorMetadata, ConnectorOutput, WorkerConnector
from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
from kvwire.connector.first_token_trailer import TRAILER_VERSION, FirstTokenTrailer
from kvwire.connector.metadata import (
    AbortSpec,
    KvwireConnectorMetadata,
    PromiseSpec,
    RecvSpec,
    SendSpec,
    TrailerSpec,
)
from kvwire.connector.metrics import ConnectorMetrics, connector_metrics
from kvwire.connector.pieces import (
    PieceBook,
    RankPiece,
    head_slice,
    held_pieces,
    pull_pieces,
    pull_releases,
    pullers,
    recv_pieces,
    send_pieces,
)
from kvwire.connector.quarantine import ReceiveQuarantine
from kvwire.connector.state import reason_label
from kvwire.errors import ConfigError, KvwireError, ProtocolError
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import (
    HEAD_DIM,
    BlockTarget,
    LayerSpec,
    PullSlice,
    TransferEvents,
    TransferTiming,
    block_ids_tensor,
    gather_blocks,
    gathered_shape,
    scatter_blocks,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_trailer_encoder = msgspec.msgpack.Encoder()
_trailer_decoder = msgspec.msgpack.Decoder(FirstTokenTrailer)


def encode_trailer(trailer: FirstTokenTrailer) -> bytes:
    """P's first-token trailer as it travels with the transfer (the worker is its one encoder)."""
    return _trailer_encoder.encode(trailer)


def decode_trailer(payload: bytes) -> FirstTokenTrailer:
    """D's side, bytes from the peer: raises :class:`ProtocolError` on a malformed payload or an
    unknown version."""
    try:
        trailer = _trailer_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # nesting past msgspec's limit: RecursionError
        raise ProtocolError(f"malformed first-token trailer: {exc}") from exc
    if trailer.v != TRAILER_VERSION:
        raise ProtocolError(f"first-token trailer version {trailer.v} not supported")
    return trailer


class AgentLike(Protocol):
    """The part of :class:`kvwire.transfer.TransferAgent` the connector uses."""

    @property
    def endpoint(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    def start_send(
        self, transfer_id: str, peer_endpoint: str | None, layers: Sequence[LayerSpec], *,
        deadline_s: float | None = None, with_trailer: bool = False,
        pull_by: str | Sequence[str] | None = None, limit_s: float | None = None,
    ) -> None: ...

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> None: ...

    def send_blocks(
        self, transfer_id: str, layer_index: int, block_ids: torch.Tensor, ready_event: Any | None = None,
        heads: range | None = None,
    ) -> None: ...

    def send_trailer(self, transfer_id: str, payload: bytes) -> None: ...

    def promise(
        self, transfer_id: str, peer_endpoint: str, *, deadline_s: float | None = None,
        limit_s: float | None = None,
    ) -> None: ...

    def expect(
        self, transfer_id: str, *, num_layers: int, deadline_s: float | None = None,
        pull_from: str | None = None, into_blocks: BlockTarget | None = None,
        accept_from: str | None = None,
        sender: str | None = None, limit_s: float | None = None, pull_slice: PullSlice | None = None,
    ) -> None: ...

    def release_pull(self, held_id: str, peer_endpoint: str, deadline_s: float | None = None) -> None: ...

    def abort(self, transfer_id: str, reason: str = "aborted") -> None: ...

    def unsettled(self) -> Mapping[str, int]: ...

    def poll(self, trailers: bool = False) -> TransferEvents: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class _Send:
    spec: SendSpec
    ids: torch.Tensor | None  # on the caches' device; built when the agent is told (a held push: later)
    piece_id: str = ""  # the agent-level transfer id (the request's own in the symmetric plan)
    heads: range | None = None  # this rank's KV heads the piece carries (None: all)
    peer: str | None = None  # push: the D rank's endpoint it goes to
    pull_by: tuple[str, ...] | None = None  # pull: the D ranks allowed to pull it
    layer_bytes: tuple[int, ...] = ()  # payload bytes per layer
    started: bool = False  # the agent knows it (start_send); a CPU-cache push starts with its layers
    num_layers_written: int = 0  # KV layers the forward wrote
    num_layers_sent: int = 0  # ... and handed to the agent
    unsent: list[int] = dataclasses.field(default_factory=list)  # written, held back (CPU caches)
    failed: bool = False
    kv_ready_unix_s: float | None = None  # wall clock when the forward wrote the last layer


@dataclasses.dataclass
class _Recv:
    spec: RecvSpec
    piece_id: str = ""  # as _Send's
    heads: range | None = None  # this rank's KV heads the piece fills (None: all)


@dataclasses.dataclass
class _StepOutput:
    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)
    first_token_ids: dict[str, int] = dataclasses.field(default_factory=dict)


class KvwireWorkerConnector(WorkerConnector):
    """See the module docstring: the face the engine and the vLLM plugin call. It holds what both
    sides share (the agent, the caches, the metrics, the local outcomes the next report carries)
    and what spans them (a report, a failure, an abort); :class:`_SendSide` and
    :class:`_ReceiveSide` hold their transfers. Closes the agent on :meth:`close` when ``owns_agent``."""

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
        self._pending = _StepOutput()  # local outcomes reported by the next get_finished
        self._sender = _SendSide(self)
        self._receiver = _ReceiveSide(self)
        self._closed = False
        self._metadata = None
        self.bytes_sent = self.bytes_received = 0  # KV payload bytes of this rank (also in metrics)

    @property
    def kv_endpoint(self) -> str:
        return self.agent.endpoint

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout | None = None) -> None:
        """``layout``: the tensors' layout when the host knows it only now (the vLLM plugin: whether
        the attention backend's cache has a head axis it can cut); else ``engine_info.kv_layout``."""
        if layout is not None:
            self._layout = layout
        self._kv_caches = list(kv_caches)
        # CPU caches: each layer the forward writes waits for the next step boundary (decision 141)
        self._sender.hold_layers = bool(self._kv_caches) and self._kv_caches[0].device.type == "cpu"
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

    def run_step(
        self,
        metadata: ConnectorMetadata,
        finished_req_ids: frozenset[str],
        forward: Callable[[WorkerConnector | None], T],
    ) -> tuple[T, ConnectorOutput]:
        """The built-in engine's one call per step (decision 131), the same work as vLLM's sequence
        of hooks in one body: hand over the KV layers the previous step held back (CPU caches,
        decision 141: that step's outputs, P's first token among them, are out by now; a push is
        announced to the agent with them, decision 147), start this step's transfers (a push from
        CPU caches: only its bookkeeping), run ``forward`` (when a send starts in this step, its
        attention layers pass each KV layer through ``save_kv_layer``; else it gets no layer hooks:
        loads never wait inside the forward and nothing is saved), end the saves (also when
        ``forward`` raises), report."""
        del finished_req_ids  # aborts arrive as AbortSpecs in the metadata
        sender = self._sender
        sender.send_saved()
        self._apply_metadata(metadata)
        try:
            result = forward(self if sender.saving else None)
        finally:
            sender.finish_saves()
        return result, self._report()

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        self._apply_metadata(metadata)

    def _apply_metadata(self, metadata: ConnectorMetadata) -> None:
        """Promises, aborts, receives, sends, withdrawn admissions, trailers: in that order. A
        withdrawal (an abort without a request id) follows the sends: the engine may have taken the
        request after all and started its send in this very step (decision 156)."""
        if not isinstance(metadata, KvwireConnectorMetadata):
            return
        sender = self._sender
        for promise in metadata.promises:
            sender.promise(promise)
        for abort in metadata.aborts:
            if abort.request_id:
                self._apply_abort(abort)
        for recv in metadata.recvs:
            self._receiver.expect(recv)
        for send in metadata.sends:
            sender.announce(send)
        for abort in metadata.aborts:
            if not abort.request_id:
                self._apply_abort(abort)
        for trailer in metadata.trailers:
            sender.send_trailer(trailer)

    def clear_connector_metadata(self) -> None:
        self._sender.finish_saves()
        self._sender.send_saved()
        super().clear_connector_metadata()

    def start_load_kv(self) -> None:
        """Loads were started at bind time (asynchronous: the requests wait in the scheduler)."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Nothing to wait for: requests resume only once all their layers are in."""
        del layer_index

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        """The forward wrote layer ``layer_index``'s KV (``kv_layer`` is that registered cache).
        GPU caches: hand its blocks (of this piece's heads) of every finishing prefill to the agent
        now, ordered after the write by an event: the plane's copy overlaps the rest of the
        forward. CPU caches: hold the layer back until :meth:`send_saved` (decision 141): the copy
        would run on the cores the forward uses, so handing it over now only delays P's first token."""
        del kv_layer  # the agent reads the registered cache itself
        self._sender.save_layer(layer_index)

    def send_saved(self) -> None:
        """Hand the agent the KV layers held back after the last forward (CPU caches), in order,
        a push's ``start_send`` first (decision 147); a send that did not get every layer then fails
        at once. Called at the start of the next step, after the engine published the step's
        outputs, and by the hook-driven host (vLLM) at the end of the forward (``wait_for_save``).
        Nothing to do on GPU caches."""
        self._sender.send_saved()

    def wait_for_save(self) -> None:
        self._sender.finish_saves()
        self._sender.send_saved()

    def get_finished(self, finished_req_ids: set[str]) -> ConnectorOutput:
        del finished_req_ids  # aborts arrive as AbortSpecs in the metadata
        return self._report()

    def _report(self) -> ConnectorOutput:
        """Outcomes since the last report: local ones, then the agent's."""
        out, self._pending = self._pending, _StepOutput()
        events = self.agent.poll(trailers=True)
        receiver = self._receiver
        receiver.trailers = events.trailers
        for tid in events.finished_sending:
            self._sender.on_sent(tid, out, events.timings.get(tid))
        for tid in events.finished_recving:
            receiver.on_received(tid, out, events.timings.get(tid))
        for tid, reason in events.failed.items():
            self._on_failed(tid, reason, out)
        if receiver.quarantine.held:  # (a call only while something is held)
            receiver.quarantine.release_settled(out)
        return ConnectorOutput(
            finished_sending=frozenset(out.finished_sending),
            finished_recving=frozenset(out.finished_recving),
            failed=out.failed,
            invalid_block_ids=frozenset(out.invalid_block_ids),
            first_token_ids=out.first_token_ids,
        )

    def promise_now(self, spec: PromiseSpec) -> None:
        """Admission thread, worker in the same process: promise at once (D's lease is renewed from
        the moment the HTTP server holds the request, decision 123); the same spec arriving again
        (the engine's admission, the next step's metadata) finds it promised and does nothing."""
        self._sender.promise(spec)

    def withdraw_now(self, spec: AbortSpec) -> None:
        """Admission thread, worker in the same process: a promised request never reached the engine
        (``RequestHooks.withdraw_request_params``): its promised pieces are aborted at the agent now
        (thread-safe; D is told); the next step's abort of it finds nothing left."""
        for piece_id in self._sender.forget_promise(spec.transfer_id) or [spec.transfer_id]:
            self._abort_agent(piece_id, spec.reason)

    # --- both sides -------------------------------------------------------------------------

    def _kv_heads(self, p_tp: int, d_tp: int) -> int | None:
        """The model's KV heads over all ranks (None for MLA: no head dimension). A host whose KV is
        opaque to kvwire (MLA layout with ``num_kv_heads`` set: heads somewhere inside each block, e.g.
        a vLLM backend without a head axis right inside the block) cannot cut heads: P and D of
        different TP sizes are refused (ConfigError), never garbled."""
        if self._layout is KVLayout.MLA:
            if self.engine_info.num_kv_heads is not None and p_tp != d_tp:
                raise ConfigError(
                    f"TP {p_tp} -> TP {d_tp} needs per-head KV slices; this host's KV layout is opaque"
                )
            return None
        if self.engine_info.num_kv_heads is not None:
            return self.engine_info.num_kv_heads
        local = int(self._kv_caches[0].shape[HEAD_DIM[self._layout]]) if self._kv_caches else 1
        return local * self.engine_info.tp_size

    def _observe_transfer(self, side: str, timing: TransferTiming) -> None:
        """A completed transfer's data timing (one call per transfer and side). The rates are
        computed here from the timing's fields (GB/s: 1e9 bytes a second)."""
        m = self._metrics
        m.transfer_seconds.labels(side=side).observe(timing.seconds)
        m.transfer_size_bytes.labels(side=side).observe(timing.num_bytes)
        gbps = timing.num_bytes / timing.seconds / 1e9 if timing.seconds > 0 else 0.0
        m.transfer_gbps.labels(side=side).observe(gbps)
        busy_s = timing.busy_seconds
        if busy_s is not None and busy_s > 0:
            m.transfer_busy_gbps.labels(side=side).observe(timing.num_bytes / busy_s / 1e9)
        m.recent.rows[side].append((timing.num_bytes, timing.seconds, busy_s))

    def _on_failed(self, tid: str, reason: str, out: _StepOutput) -> None:
        """A piece failed (reported by the agent, or found here): each side ends its part."""
        self._sender.on_failed(tid, reason, out)
        recv = self._receiver.recvs.get(tid)
        if recv is not None:
            self._receiver.piece_failed(recv, reason, out)

    def _apply_abort(self, spec: AbortSpec) -> None:
        """Cancel every piece of the request's transfer on this rank. P: the request's blocks are
        reported free now, as after a failed send: the pieces are forgotten here, so what the agent
        reports of them later (failed, or sent) reports nothing; a send withdrawn after the engine
        took its request (decision 146) held P's blocks for ever (decision 156)."""
        receiver = self._receiver
        recv_group = receiver.pieces.drop(spec.transfer_id)
        send_group = self._sender.pieces.drop(spec.transfer_id)
        piece_ids = {spec.transfer_id, *self._sender.forget_promise(spec.transfer_id)}
        piece_ids |= recv_group.pending if recv_group is not None else set()
        piece_ids |= send_group.pending if send_group is not None else set()
        recvs = [receiver.recvs[p].spec for p in piece_ids if p in receiver.recvs]
        for piece_id in sorted(piece_ids):
            self._abort_piece(piece_id, spec.reason)
        if send_group is not None and not spec.report_free:
            self._pending.finished_sending.add(send_group.request_id)
        if spec.report_free:  # D: the engine frees the blocks once no sender may write into them
            blocks = _blocks_written(recvs[0]) if recvs else 0
            receiver.quarantine.report_when_settled(
                spec.request_id, blocks, piece_ids, lambda o: o.finished_sending.add(spec.request_id),
                self._pending,
            )  # fmt: skip

    def _abort_piece(self, piece_id: str, reason: str) -> None:
        recv = self._receiver.recvs.pop(piece_id, None)
        send = self._sender.drop(piece_id)
        if recv is not None:
            self._count_failure("recv", "aborted")
        if send is not None:
            self._count_failure("send", "aborted")
        self._abort_agent(piece_id, reason)

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
    def num_quarantined_blocks(self) -> int:
        """D's blocks held back from the engine while a stalled sender may write into them."""
        return self._receiver.quarantine.num_blocks

    @property
    def num_live_transfers(self) -> int:
        return len(self._sender.sends) + len(self._receiver.recvs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender.close()
        self._receiver.close()
        if self._owns_agent:
            self.agent.close()


class _SendSide:
    """P's half of one rank's connector: each piece this rank sends, from the promise that renews
    D's lease until the send starts, through the KV layers the forward hands over (held back to the
    step boundary on CPU caches, a push announced to the agent with them), to the first-token
    trailer that follows the last layer. Shared state and cross-side work: the owning connector."""

    def __init__(self, conn: KvwireWorkerConnector) -> None:
        self._conn = conn
        self._agent = conn.agent
        self._metrics = conn._metrics
        self.hold_layers = False  # CPU caches (set with the caches): layers wait for send_saved
        self.sends: dict[str, _Send] = {}  # piece transfer id -> live send
        # Request transfer id -> this rank's pieces (P and D of different TP sizes: pieces.py).
        self.pieces = PieceBook()
        self.promised: dict[str, list[str]] = {}  # request transfer id -> piece ids promised, not started
        self.promised_ok: set[str] = set()  # ... of which the agent took every piece's promise
        self.saving: list[_Send] = []  # sends whose layers this step's forward hands over
        self.unsent: list[_Send] = []  # sends with layers held back, for send_saved

    def save_layer(self, layer_index: int) -> None:
        """:meth:`KvwireWorkerConnector.save_kv_layer`'s work."""
        num_layers = len(self._conn._kv_caches)
        event = None
        for send in self.saving:
            if send.failed:
                continue
            send.num_layers_written += 1
            if send.num_layers_written == num_layers:
                send.kv_ready_unix_s = time.time()
            if self.hold_layers:
                send.unsent.append(layer_index)
                continue
            if event is None and send.ids is not None and send.ids.is_cuda:
                event = torch.cuda.Event()
                event.record()
            self._hand_over(send, layer_index, event)

    def _hand_over(self, send: _Send, layer_index: int, event: Any | None) -> None:
        assert send.ids is not None  # set when the send started
        try:
            self._agent.send_blocks(send.piece_id, layer_index, send.ids, event, heads=send.heads)
        except KvwireError as exc:
            logger.warning("transfer %s: send_blocks failed: %s", send.piece_id, exc)
            send.failed = True
            return
        send.num_layers_sent += 1
        if send.spec.peer_endpoints:  # pull: counted once pulled (pieces may take part of it)
            self._count_sent(send.layer_bytes[layer_index])

    def send_saved(self) -> None:
        """:meth:`KvwireWorkerConnector.send_saved`'s work."""
        if not self.unsent:  # every step's call on GPU caches, and most on CPU ones
            return
        unsent, self.unsent = self.unsent, []
        for send in unsent:
            layers, send.unsent = send.unsent, []
            if not send.started and not self._start_held(send):
                continue
            for layer_index in layers:
                if send.failed or send.piece_id not in self.sends:
                    break  # failed or aborted meanwhile
                self._hand_over(send, layer_index, None)
            self._fail_if_short(send, send.num_layers_sent)

    def finish_saves(self) -> None:
        """After the forward: a send that did not get every KV layer can never complete; fail it now
        rather than at its deadline. Layers held back wait for :meth:`send_saved`."""
        if not self.saving:  # every step but one a send starts in (vLLM calls this twice a step)
            return
        num_layers = len(self._conn._kv_caches)
        for send in self.saving:
            if self.hold_layers and send.num_layers_written == num_layers:
                self.unsent.append(send)
            else:
                done = send.num_layers_written if self.hold_layers else send.num_layers_sent
                self._fail_if_short(send, done)
        self.saving = []

    def _fail_if_short(self, send: _Send, num_layers: int) -> None:
        conn = self._conn
        if num_layers < len(conn._kv_caches) and send.piece_id in self.sends:
            reason = f"mismatch: {num_layers} of {len(conn._kv_caches)} layers saved"
            conn._abort_agent(send.piece_id, reason)  # a send not started yet: its promise ends
            if not send.started:  # the agent reports no failure of a send it never knew
                self.on_failed(send.piece_id, reason, conn._pending)

    def send_trailer(self, spec: TrailerSpec) -> None:
        for piece_id in sorted(self.pieces.pieces(spec.transfer_id)):
            send = self.sends.get(piece_id)
            if send is not None and not send.started:
                self.send_saved()  # the trailer follows the layers (a host that bound it first)
                send = self.sends.get(piece_id)
            if send is None or not send.started:
                continue  # already failed or aborted
            trailer = msgspec.structs.replace(spec.first_token, kv_ready_unix_s=send.kv_ready_unix_s)
            try:
                self._agent.send_trailer(piece_id, encode_trailer(trailer))
            except KvwireError as exc:
                logger.warning("transfer %s: send_trailer failed: %s", piece_id, exc)

    def _count_sent(self, num_bytes: int) -> None:
        self._conn.bytes_sent += num_bytes
        self._metrics.send_bytes.inc(num_bytes)

    def on_sent(self, tid: str, out: _StepOutput, timing: TransferTiming | None) -> None:
        send = self.sends.pop(tid, None)
        if send is not None:
            if not send.spec.peer_endpoints:  # pull: the bytes every puller took of the held layer
                self._count_sent(timing.num_bytes if timing is not None else 0)
            self._metrics.transfers_completed.labels(side="send").inc()
            self._piece_done(tid, out)
        if timing is not None:
            self._conn._observe_transfer("send", timing)

    def _piece_done(self, piece_id: str, out: _StepOutput) -> None:
        """P frees the request's blocks once every piece this rank sends is acknowledged or failed."""
        group = self.pieces.finish(piece_id)
        if group is not None and not group.pending:
            out.finished_sending.add(group.request_id)

    def on_failed(self, tid: str, reason: str, out: _StepOutput) -> None:
        """A piece of ours failed: D resumes only with every piece, so end this rank's other pieces
        of the request now; P's blocks are freed once no piece is in flight."""
        send = self.sends.pop(tid, None)
        if send is None:
            return
        conn = self._conn
        conn._count_failure("send", reason)
        for sibling in sorted(self.pieces.pieces(send.spec.transfer_id) - {tid}):
            if sibling in self.sends:
                conn._abort_piece(sibling, f"a sibling piece failed: {reason}")
                self.pieces.finish(sibling, failed=True)
        self._piece_done(tid, out)

    def drop(self, piece_id: str) -> _Send | None:
        """Forget an aborted piece (its layers are handed over no more); the send, if it was live."""
        send = self.sends.pop(piece_id, None)
        if send is not None:
            self.saving = [s for s in self.saving if s is not send]
            self.unsent = [s for s in self.unsent if s is not send]
        return send

    def announce(self, spec: SendSpec) -> None:
        self.forget_promise(spec.transfer_id)  # the sends replace the promises
        conn = self._conn
        info = conn.engine_info
        tid, rank, d_tp = spec.transfer_id, info.rank, len(spec.peer_endpoints or spec.pull_by)
        pull_by: tuple[str, ...] | None = None  # pull: the D ranks this rank's held layer is served to
        try:
            if spec.peer_endpoints:
                pieces = send_pieces(tid, rank, info.tp_size, d_tp, conn._kv_heads(info.tp_size, d_tp))
            else:  # pull: hold the whole layer (D's size may be unknown; each D rank pulls its piece)
                pieces = held_pieces(tid, rank, info.tp_size)
                if spec.pull_by:
                    pull_by = pullers(rank, info.tp_size, spec.pull_by, conn._kv_heads(info.tp_size, d_tp))
                    pieces = pieces if pull_by else ()
        except ConfigError as exc:
            conn._pending.finished_sending.add(spec.request_id)
            conn._count_failure("send", f"mismatch: {exc}")
            return
        if not pieces:  # a replica: another rank of ours sends these heads
            conn._pending.finished_sending.add(spec.request_id)
            return
        self._add(spec, pieces, pull_by)

    def _add(self, spec: SendSpec, pieces: Sequence[RankPiece], pull_by: tuple[str, ...] | None) -> None:
        """Start the request's pieces on this rank, all or none."""
        conn = self._conn
        ids = None if self.hold_layers and spec.peer_endpoints else conn._ids(spec.block_ids)
        sends: list[_Send] = []
        for piece in pieces:
            send = self._start_piece(spec, ids, piece, pull_by)
            if send is None:
                for started in sends:
                    conn._abort_agent(started.piece_id, "a sibling piece failed to start")
                conn._pending.finished_sending.add(spec.request_id)
                return
            sends.append(send)
        self.pieces.add(spec.transfer_id, spec.request_id, [s.piece_id for s in sends])
        for send in sends:
            self._metrics.transfers_started.labels(side="send").inc()
            self.sends[send.piece_id] = send
            self.saving.append(send)

    def _start_piece(
        self, spec: SendSpec, ids: torch.Tensor | None, piece: RankPiece, pull_by: tuple[str, ...] | None
    ) -> _Send | None:
        """The piece's send; announced to the agent now, or, pushing from CPU caches, with its
        layers at the next step boundary (:meth:`send_saved`, decision 147): the Offer and the
        agent's work then follow P's first token instead of delaying it, and D's lease stays
        renewed by the promise meanwhile."""
        peer = spec.peer_endpoints[piece.peer_rank] if spec.peer_endpoints else None
        send = _Send(spec, ids, piece.transfer_id, piece.heads, peer, pull_by)
        if self.hold_layers and spec.peer_endpoints:
            return send
        error = self._start_agent_send(send)
        if error is not None:
            self._conn._count_failure("send", error)
            return None
        return send

    def _start_held(self, send: _Send) -> bool:
        """Start a held push with its layers; False when it is over: aborted meanwhile, or refused
        by the agent (then failed here like a send the agent failed, reported by the next report)."""
        if send.piece_id not in self.sends:
            return False
        error = self._start_agent_send(send)
        if error is not None:
            self.on_failed(send.piece_id, error, self._conn._pending)
            return False
        return True

    def _start_agent_send(self, send: _Send) -> str | None:
        """``start_send`` of one piece; the agent's refusal (logged) when it refused it. A refused
        piece is aborted at the agent too: its promise (decision 051) would otherwise renew D's
        lease on a send that never comes until the promise's limit."""
        conn = self._conn
        spec, n, layout = send.spec, len(send.spec.block_ids), conn._layout
        layers = [
            LayerSpec(gathered_shape(head_slice(c, send.heads, layout), n, layout), c.dtype)
            for c in conn._kv_caches
        ]
        try:
            self._agent.start_send(
                send.piece_id, send.peer, layers, deadline_s=spec.deadline_s, with_trailer=spec.with_trailer,
                pull_by=send.pull_by, limit_s=spec.limit_s,
            )
        except KvwireError as exc:
            logger.warning("transfer %s: start_send failed: %s", send.piece_id, exc)
            conn._abort_agent(send.piece_id, f"start refused: {exc}")
            return str(exc)
        if send.ids is None:
            send.ids = conn._ids(spec.block_ids)
        send.layer_bytes, send.started = tuple(layer.num_bytes for layer in layers), True
        return None

    def promise(self, spec: PromiseSpec) -> None:
        """P accepted a request: renew D's lease on each piece this rank will send until the send
        starts (decision 051; with equal TP sizes the one piece is the request's own transfer).
        Once the agent took every piece's promise, the same spec again is a no-op here (decision
        147: it arrives up to three more times, on the engine thread, before P's forward); after a
        refused one it is tried again."""
        info, d_tp, tid = self._conn.engine_info, len(spec.peer_endpoints), spec.transfer_id
        if tid in self.promised_ok:
            return
        try:
            pieces = send_pieces(tid, info.rank, info.tp_size, d_tp, self._conn._kv_heads(info.tp_size, d_tp))
        except ConfigError:
            return  # the send is refused when it starts (and D's pieces with it)
        self.promised[spec.transfer_id] = [piece.transfer_id for piece in pieces]
        taken = 0
        for piece in pieces:
            try:
                self._agent.promise(piece.transfer_id, spec.peer_endpoints[piece.peer_rank],
                                    deadline_s=spec.deadline_s, limit_s=spec.limit_s)  # fmt: skip
                taken += 1
            except KvwireError as exc:
                logger.warning("transfer %s: promise failed: %s", piece.transfer_id, exc)
        if taken == len(pieces):
            self.promised_ok.add(tid)

    def forget_promise(self, transfer_id: str) -> list[str]:
        """The request's promised piece ids (none left promised after this)."""
        self.promised_ok.discard(transfer_id)
        return self.promised.pop(transfer_id, [])

    def close(self) -> None:
        self.sends.clear()
        self.saving = []
        self.unsent = []


class _ReceiveSide:
    """D's half of one rank's connector: each piece this rank receives (pushed to it or pulled from
    P), its first-token trailer, and the load-failure policy once no sender may write into the
    blocks any more (:mod:`kvwire.connector.quarantine`). Shared state and cross-side work: the
    owning connector."""

    def __init__(self, conn: KvwireWorkerConnector) -> None:
        self._conn = conn
        self._agent = conn.agent
        self._metrics = conn._metrics
        self.recvs: dict[str, _Recv] = {}  # piece transfer id -> live receive
        self.pieces = PieceBook()  # request transfer id -> this rank's pieces
        self.trailers: dict[str, bytes] = {}  # the last poll's trailers, by transfer id
        # failed/aborted receives a stalled sender may still write into: reported once it cannot
        self.quarantine: ReceiveQuarantine[_StepOutput] = ReceiveQuarantine(
            conn.agent, conn._metrics.quarantined_blocks
        )

    def expect(self, spec: RecvSpec) -> None:
        conn, info = self._conn, self._conn.engine_info
        p_tp = len(spec.pull_from) or spec.peer_tp_size or info.tp_size
        try:
            plan = pull_pieces if spec.pull_from else recv_pieces
            pieces = plan(spec.transfer_id, info.rank, p_tp, info.tp_size, conn._kv_heads(p_tp, info.tp_size))
        except ConfigError as exc:
            self._failed(_Recv(spec), f"mismatch: {exc}", conn._pending)
            return
        if spec.pull_from:  # first: whatever becomes of this request, nobody pulls those replicas
            self._release_replicas(spec, p_tp)
        recvs = [_Recv(spec, piece.transfer_id, piece.heads) for piece in pieces]
        self.pieces.add(spec.transfer_id, spec.request_id, [r.piece_id for r in recvs])
        for recv, piece in zip(recvs, pieces, strict=True):
            self.recvs[recv.piece_id] = recv
            try:
                self._expect_piece(recv, piece)
            except KvwireError as exc:
                self.piece_failed(recv, str(exc), conn._pending)
                return
            self._metrics.transfers_started.labels(side="recv").inc()

    def _expect_piece(self, recv: _Recv, piece: RankPiece) -> None:
        """The agent's ``expect`` of one piece. P's payload starts at D's block ``first_block`` (a
        partial transfer: P skips the prefix the router said D holds); D writes from
        ``skip_blocks`` on (what it holds itself now)."""
        spec = recv.spec
        ids = tuple(spec.block_ids[spec.skip_blocks :])
        pull_from = spec.pull_from[piece.peer_rank] if spec.pull_from else None
        senders = spec.sender_endpoints
        accept_from = senders[piece.peer_rank] if piece.peer_rank < len(senders) else None
        target = BlockTarget(ids, spec.skip_blocks - spec.first_block, heads=piece.heads)
        self._agent.expect(
            recv.piece_id, num_layers=len(self._conn._kv_caches), into_blocks=target,
            deadline_s=spec.deadline_s, pull_from=pull_from, accept_from=accept_from,
            sender=accept_from, limit_s=spec.limit_s, pull_slice=piece.source,
        )

    def _release_replicas(self, spec: RecvSpec, p_tp: int) -> None:
        """Pull, KV heads replicated on P: tell the P ranks nobody pulls from to free their blocks."""
        info = self._conn.engine_info
        heads = self._conn._kv_heads(p_tp, info.tp_size)
        for p_rank, held_id in pull_releases(spec.transfer_id, info.rank, p_tp, info.tp_size, heads):
            try:
                self._agent.release_pull(held_id, spec.pull_from[p_rank], deadline_s=spec.deadline_s)
            except KvwireError as exc:
                logger.warning("transfer %s: release failed: %s", held_id, exc)

    def on_received(self, tid: str, out: _StepOutput, timing: TransferTiming | None) -> None:
        recv = self.recvs.pop(tid, None)
        if recv is None:
            return
        self._metrics.transfers_completed.labels(side="recv").inc()
        if timing is not None:
            self._conn.bytes_received += timing.num_bytes
            self._metrics.recv_bytes.inc(timing.num_bytes)
            self._conn._observe_transfer("recv", timing)
        group = self.pieces.finish(tid)
        if recv.spec.want_trailer and group is not None:
            trailer = self._read_trailer(tid)  # every piece carries it: take each, keep one
            if trailer is not None and group.first_token is None:
                group.first_token = trailer.token_id
                self._observe_exposed(trailer, timing)
        if group is None or group.pending:
            return  # other pieces of this rank still arriving
        out.finished_recving.add(recv.spec.request_id)
        if group.first_token is not None:
            out.first_token_ids[recv.spec.request_id] = group.first_token

    def _observe_exposed(self, trailer: FirstTokenTrailer, timing: TransferTiming | None) -> None:
        """P's last layer computed -> D holds it all (and -> D's engine step has it)."""
        if trailer.kv_ready_unix_s is None:
            return
        now = time.time()
        landed = timing.done_unix_s if timing is not None and timing.done_unix_s else now
        exposed = max(landed - trailer.kv_ready_unix_s, 0.0)
        to_step = max(now - trailer.kv_ready_unix_s, 0.0)
        self._metrics.handover_seconds.labels(phase="exposed").observe(exposed)
        self._metrics.handover_seconds.labels(phase="exposed_to_step").observe(to_step)
        recent = self._metrics.recent
        recent.exposed.append(exposed)
        recent.exposed_to_step.append(to_step)

    def piece_failed(self, recv: _Recv, reason: str, out: _StepOutput) -> None:
        """One piece failed: end this rank's other pieces of the request, apply the policy once
        (once no sender may write into the blocks any more)."""
        self.recvs.pop(recv.piece_id, None)
        group = self.pieces.drop(recv.spec.transfer_id)
        pieces = {recv.piece_id}
        for piece_id in group.pending if group is not None else ():
            other = self.recvs.pop(piece_id, None)
            if other is not None and other is not recv:
                self._conn._abort_agent(piece_id, f"a sibling piece failed: {reason}")
                pieces.add(piece_id)
        self._conn._count_failure("recv", reason)
        self.quarantine.report_when_settled(
            recv.spec.request_id, _blocks_written(recv.spec), pieces,
            lambda o: self._apply_load_policy(recv, reason, o), out,
        )  # fmt: skip

    def _read_trailer(self, tid: str) -> FirstTokenTrailer | None:
        try:
            payload = self.trailers.pop(tid, None)
            return None if payload is None else decode_trailer(payload)
        except KvwireError as exc:
            logger.warning("transfer %s: no usable first token (%s); recomputing it", tid, exc)
            return None

    def _failed(self, recv: _Recv, reason: str, out: _StepOutput) -> None:
        self._conn._count_failure("recv", reason)
        self._apply_load_policy(recv, reason, out)

    def _apply_load_policy(self, recv: _Recv, reason: str, out: _StepOutput) -> None:
        """Apply the load-failure policy: recompute (report the blocks invalid) or fail the request."""
        request_id = recv.spec.request_id
        if self._conn.config.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE:
            logger.warning("request %s: remote KV load failed (%s); recomputing", request_id, reason)
            out.finished_recving.add(request_id)
            out.invalid_block_ids.update(recv.spec.block_ids)
        else:
            logger.warning("request %s: remote KV load failed (%s); failing it", request_id, reason)
            out.failed[request_id] = f"remote KV load failed: {reason}"

    def close(self) -> None:
        self.recvs.clear()
        self.quarantine.close()


def _blocks_written(spec: RecvSpec) -> int:
    """D's blocks a receive writes into (after those it holds itself)."""
    return len(spec.block_ids) - spec.skip_blocks
