"""TransferAgent: one per process (per GPU worker); moves KV layers to/from peer agents.

Threads: the control thread (:mod:`kvwire.transfer.control`: ZMQ I/O, message handling, deadlines,
ack flushing, delayed sink deliveries) and the data plane's threads (:mod:`kvwire.transfer.planes.base`);
what they report goes through :mod:`kvwire.transfer.routes` to the side that holds the transfer
(:mod:`kvwire.transfer.sender`, :mod:`kvwire.transfer.receiver`).
Caller threads only touch in-memory state under the agent lock and queue work: no public method
waits on the network. Completion is reported through :meth:`TransferAgent.poll`.

Failure model: every transfer has a deadline; expiry, ``abort``, a peer's Abort, a broken data
connection or a restarted peer (new instance id at the same endpoint) end it as FAILED with a reason
on this side and (where the peer is still reachable) on the other, and free what it held.

Supervision (decision 116): the control thread is a supervised component of ``board`` (the process's
:class:`~kvwire.supervision.HealthBoard`; ``agent.board``). If it fails too often it is dead: every
transfer in flight fails at once (``closed: ...``, seen in :meth:`TransferAgent.poll`), new ones are
refused with a TransferError, and the board (``/health``, ``kvwire_component_up``) names it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch

from kvwire.errors import TransferError
from kvwire.supervision import HealthBoard
from kvwire.transfer.buffers import RecvMemory
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.control import ControlLoop
from kvwire.transfer.core import Core
from kvwire.transfer.enums import FailReason, KVLayout
from kvwire.transfer.planes.base import DataPlane, PlaneSet
from kvwire.transfer.planes.factory import make_plane
from kvwire.transfer.receiver import Receiver
from kvwire.transfer.registered_caches import BlockTarget, PagedKV
from kvwire.transfer.routes import Routes
from kvwire.transfer.sender import Sender
from kvwire.transfer.stats import TransferStats
from kvwire.transfer.types import ByteSpans, LayerSink, LayerSpec, PullSlice, TransferEvents

log = logging.getLogger("kvwire.transfer")


class TransferAgent:
    """Asynchronous per-transfer KV mover. Thread-safe; a context manager; ``close()`` stops all."""

    def __init__(
        self,
        config: TransferConfig,
        plane_factory: Callable[[TransferConfig, str, HealthBoard], DataPlane] = make_plane,
        *,
        board: HealthBoard | None = None,
    ) -> None:
        """``plane_factory(config, instance_id, board)`` builds the data plane (default: the one
        ``config.backend`` names; tests pass fakes). ``board``: the process's health board, which
        lists the agent's supervised threads (None: a private one)."""
        self.config = config
        self.board = board if board is not None else HealthBoard()
        self._instance_id = secrets.token_hex(8)
        self._paged: PagedKV | None = None
        # every held plane behind one DataPlane, routed per peer (negotiated; decision 075)
        self._planes = plane = plane_factory(config, self._instance_id, self.board)
        pinned = config.device.startswith("cuda")
        mem = RecvMemory(config.recv_budget_bytes, config.spill_budget_bytes, plane.allocate, pinned=pinned)
        self._core = core = Core(config, self._instance_id, plane, mem)
        self._sender = Sender(core)
        self._receiver = Receiver(core)
        # control messages, ticks and plane reports go to the side holding the transfer they name
        self._routes = routes = Routes(core, self._sender, self._receiver)
        plane.start(routes)
        try:
            core.control = ControlLoop(
                config, routes.on_message, routes.on_reject, routes.on_tick, routes.on_unreachable,
                board=self.board, on_dead=routes.on_control_dead, on_limit=core.stats.limit_hit,
            )  # fmt: skip
        except BaseException:
            plane.close()
            raise
        core.control.start()
        bound = core.control.bound_endpoint
        via = "" if bound == core.endpoint else f", listening at {bound}"
        log.info("transfer agent %s at %s (data %s%s)", self._instance_id, core.endpoint, plane.address, via)

    @property
    def endpoint(self) -> str:
        """Control endpoint to advertise ("tcp://host:port")."""
        return self._core.endpoint

    @property
    def data_address(self) -> str:
        """The data plane's address (TCP: "host:port"); peers learn it from control messages."""
        return self._core.plane.address

    @property
    def transports(self) -> list[str]:
        """The data planes this agent holds, in preference order (e.g. ``["shm", "tcp"]``)."""
        if not isinstance(self._planes, PlaneSet):
            return []  # a single plane a caller built (plane_factory)
        return [backend.value for backend in self._planes.members]

    def peer_transports(self) -> dict[str, str]:
        """Peer control endpoint -> the data plane negotiated with it (``"none"``: the pair has
        none, its transfers fail with ``transport``). Latest epoch of each peer seen."""
        return self._planes.peer_transports() if isinstance(self._planes, PlaneSet) else {}

    @property
    def instance_id(self) -> str:
        """Random per agent start: the epoch peers use to detect a restart."""
        return self._instance_id

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> None:
        """Register the worker's paged KV caches (one tensor per KV-bearing layer, index = layer
        index in transfers) once, before any :meth:`send_blocks` or ``expect(into_blocks=...)``. The
        agent then moves blocks the plane's fastest way (``kvwire.transfer.registered_caches``). The tensors
        must stay allocated for the agent's life."""
        paged = PagedKV(kv_caches, layout)
        with self._core.lock:
            self._check_open()
            self._paged = paged
        self._planes.register_memory(paged.layers)  # e.g. shared-memory caches: exported to peers

    def block_layers(self, num_blocks: int, heads: range | None = None) -> list[LayerSpec]:
        """The layer specs of a transfer of ``num_blocks`` blocks of every registered layer (only KV
        ``heads`` of each block, when given)."""
        paged = self._registered().heads(heads)
        return [paged.spec(index, num_blocks) for index in range(paged.num_layers)]

    def _registered(self) -> PagedKV:
        if self._paged is None:
            raise TransferError("register_kv_caches first")
        return self._paged

    # --- send side ---------------------------------------------------------------------------------------

    def start_send(
        self,
        transfer_id: str,
        peer_endpoint: str | None,
        layers: Sequence[LayerSpec],
        *,
        deadline_s: float | None = None,
        with_trailer: bool = False,
        pull_by: str | Sequence[str] | None = None,
        limit_s: float | None = None,
    ) -> None:
        """Announce a transfer to ``peer_endpoint`` (one Offer message), or hold it for a pull
        (``peer_endpoint`` None: lease until the deadline). Never blocks on the network.
        ``pull_by``: the control endpoint(s) allowed to pull it (others are refused and counted in
        ``offers_refused``); None: the first puller. A held transfer of blocks (:meth:`send_blocks`)
        may also be pulled in pieces, a head range each (``expect(pull_slice=...)``).

        ``deadline_s`` is a liveness lease (:mod:`kvwire.transfer.lease`): renewed while the
        receiver shows life, never past ``limit_s`` (default ``config.default_limit_s``).

        ``transfer_id``: caller-given, unique (e.g. a uuid minted by the router); do not reuse an id
        for a new transfer between the same agents (ended ids are remembered to reject late
        messages)."""
        with self._core.lock:
            self._check_open()
            deadline = self.config.default_deadline_s if deadline_s is None else deadline_s
            limit = self.config.default_limit_s if limit_s is None else limit_s
            pullers = None
            if pull_by is not None:
                pullers = frozenset((pull_by,)) if isinstance(pull_by, str) else frozenset(pull_by)
            self._sender.start(transfer_id, peer_endpoint, layers, deadline, with_trailer, pullers, limit)

    def promise(
        self, transfer_id: str, peer_endpoint: str, *, deadline_s: float | None = None,
        limit_s: float | None = None,
    ) -> None:  # fmt: skip
        """Tell ``peer_endpoint`` (the receiver) that this side accepted ``transfer_id`` and will
        send it (its prefill may be queued): the receiver's lease on it is renewed (state QUEUED)
        until :meth:`start_send` or :meth:`abort`, as long as the receiver answers within
        ``deadline_s`` and for at most ``limit_s``. Idempotent; never blocks."""
        with self._core.lock:
            self._check_open()
            deadline = self.config.default_deadline_s if deadline_s is None else deadline_s
            limit = self.config.default_limit_s if limit_s is None else limit_s
            self._sender.promise(transfer_id, peer_endpoint, deadline, limit)
        control = self._core.control
        assert control is not None
        control.wake()

    def send_layer(
        self, transfer_id: str, layer_index: int, tensor: torch.Tensor, ready_event: Any | None = None
    ) -> None:
        """Hand over one layer (contiguous, as announced). The agent keeps a reference until the
        transfer ends; do not modify the tensor meanwhile. No-op if the transfer already failed."""
        with self._core.lock:
            self._check_open()
            self._sender.add_layer(transfer_id, layer_index, tensor, ready_event)

    def send_layer_spans(
        self, transfer_id: str, layer_index: int, spans: ByteSpans, ready_event: Any | None = None
    ) -> None:
        """Hand over one layer as byte spans of a contiguous tensor (e.g. its blocks in the paged
        cache: ``paged.block_spans(kv, block_ids, layout)``). A plane that supports spans (TCP) sends
        straight from them (no gather copy); otherwise the agent gathers here. The bytes must not
        change until the transfer ends."""
        with self._core.lock:
            self._check_open()
            self._sender.add_layer_spans(transfer_id, layer_index, spans, ready_event)

    def send_blocks(
        self,
        transfer_id: str,
        layer_index: int,
        block_ids: torch.Tensor,
        ready_event: Any | None = None,
        heads: range | None = None,
    ) -> None:
        """Hand over one layer as blocks ``block_ids`` (int64, in token order; on the caches' device
        for GPU caches) of the registered caches — the serving path. ``ready_event``: a CUDA event
        recorded after the layer's KV was written. ``heads``: only these KV heads of each block (a
        tensor-parallel peer's share). The blocks must not change until the transfer ends. No-op if
        the transfer already failed."""
        paged = self._registered().heads(heads)
        with self._core.lock:
            self._check_open()
            self._sender.add_layer_blocks(transfer_id, layer_index, paged, block_ids, ready_event)

    def send_trailer(self, transfer_id: str, payload: bytes) -> None:
        """Small bytes delivered to the receiver with completion (``with_trailer=True`` transfers)."""
        with self._core.lock:
            self._check_open()
            self._sender.add_trailer(transfer_id, payload)

    # --- receive side ------------------------------------------------------------------------------------

    def expect(
        self,
        transfer_id: str,
        *,
        num_layers: int,
        sink: LayerSink | None = None,
        deadline_s: float | None = None,
        pull_from: str | None = None,
        scatter_into: Callable[[int], ByteSpans] | None = None,
        into_blocks: BlockTarget | None = None,
        accept_from: str | None = None,
        sender: str | None = None,
        limit_s: float | None = None,
        pull_slice: PullSlice | None = None,
    ) -> None:
        """Announce an incoming transfer (before or after its data arrives). ``sink(index, tensor)``
        runs on a transfer thread per layer (tensor valid during the call only); without a sink the
        layers are buffered for :meth:`take_layers`. ``pull_from``: ask that sender (pull mode).

        ``scatter_into(index) -> ByteSpans`` (instead of a sink): where layer ``index``'s bytes go,
        e.g. ``paged.block_spans(kv_cache[index], block_ids, layout)``. A plane that supports spans
        (TCP) receives straight into them, no buffer and no copy; others copy on arrival. Called under
        the agent lock when a layer is granted: must be cheap and must not call the agent. The spans
        must stay valid until the transfer ends (finished or failed).

        ``into_blocks`` (the serving path; :meth:`register_kv_caches` first): every layer lands in
        those blocks of its registered cache, the plane's fastest way — in place where the payload
        fits the blocks exactly, else through a copy that skips/drops blocks (see ``registered_caches``). The
        blocks must not be reused until the transfer ended; once it failed (or an abort of it
        returned) and it is not in :meth:`unsettled`, nothing of it writes into them any more.

        ``accept_from`` (default ``pull_from``): the sender's control endpoint; offers of this id from
        any other agent are refused (counted in ``offers_refused``), so a third agent that knows the
        id cannot inject data. Raises TransferError if another agent offered it already.

        ``deadline_s`` is a liveness lease: renewed while the sender (``pull_from``, the Offer's
        sender, or ``sender``: push mode's sender endpoint when known in advance) shows life, so a
        slow but alive sender (prefill queued) does not fail it; never past ``limit_s``.

        ``pull_slice`` (with ``pull_from``): pull one piece of a transfer the sender holds for several
        receivers (its ``held_id``; ``transfer_id`` is this piece's own id), only the KV heads it names."""
        if sum(x is not None for x in (sink, scatter_into, into_blocks)) > 1:
            raise ValueError("expect: give at most one of sink, scatter_into, into_blocks")
        target = None if into_blocks is None else (self._registered().heads(into_blocks.heads), into_blocks)
        deadline = self.config.default_deadline_s if deadline_s is None else deadline_s
        with self._core.lock:
            self._check_open()
            deliver = self._receiver.expect(
                transfer_id, num_layers, sink, deadline, pull_from, scatter_into, target, accept_from,
                sender, limit_s, pull_slice,
            )  # fmt: skip
        if deliver:
            control = self._core.control
            assert control is not None
            control.call_soon(lambda: self._routes.deliver_held(transfer_id))

    def release_pull(self, held_id: str, peer_endpoint: str, deadline_s: float | None = None) -> None:
        """Pull mode: tell ``peer_endpoint`` that nothing of the transfer it holds as ``held_id`` is
        wanted (a replica of KV heads another of its ranks serves): it ends that transfer as finished
        and frees what it held. Fire and forget; never blocks."""
        with self._core.lock:
            self._check_open()
            self._receiver.release(held_id, peer_endpoint, deadline_s or self.config.default_deadline_s)

    def take_layers(self, transfer_id: str) -> dict[int, torch.Tensor]:
        """The buffered layers of a transfer in ``finished_recving`` (no-sink case), once."""
        with self._core.lock:
            return self._receiver.take_layers(transfer_id)

    def take_trailer(self, transfer_id: str) -> bytes | None:
        """The trailer of a transfer in ``finished_recving``, once (None if none came)."""
        with self._core.lock:
            return self._receiver.take_trailer(transfer_id)

    # --- both sides --------------------------------------------------------------------------------------

    def abort(self, transfer_id: str, reason: str = FailReason.ABORTED.value) -> None:
        """End the transfer as FAILED on both sides and free everything it holds. Idempotent. The
        local failure reads ``"aborted: <reason>"`` (the peer's ``"peer_aborted: <reason>"``)."""
        with self._core.lock:
            label = FailReason.ABORTED.value
            local = FailReason.ABORTED.says(reason)
            self._sender.promises.forget(transfer_id, reason)
            self._sender.fail(transfer_id, local, notify=True, label=label, wire_reason=reason)
            self._receiver.fail(transfer_id, local, notify=True, label=label, wire_reason=reason)
            self._receiver.drop_done(transfer_id)

    def unsettled(self) -> dict[str, int]:
        """Failed or aborted receives whose sender may still write into their destinations (a
        stalled shared-memory sender kept its grant past the revoke wait: decision 114), with the
        bytes each covers. Reuse a receive's blocks only once it is absent here; a transfer leaves
        this map when its sender let go of the grant or its process ended. Any thread."""
        return self._core.plane.unsettled()

    def poll(self) -> TransferEvents:
        """Events since the last poll, swapped out atomically; each transfer id is reported once."""
        return self._core.events.swap()

    def wait(self, timeout_s: float) -> bool:
        """Block until :meth:`poll` has an event to report, at most ``timeout_s`` seconds; True if
        it has. For a caller with nothing else to do (a benchmark, an idle engine loop): it sleeps
        instead of polling in a loop, which costs a core's time in wake-ups."""
        return self._core.events.wait(timeout_s)

    def stats(self) -> TransferStats:
        core = self._core
        with core.lock:
            active = len(self._sender.sends) + len(self._receiver.recvs)
        unsettled = core.plane.unsettled()
        return core.stats.snapshot(
            spill_bytes_in_use=core.memory.spill.in_use_bytes,
            budget_bytes_in_use=core.memory.budget_in_use,
            transfers_active=active,
            quarantined_transfers=len(unsettled),
            quarantined_bytes=sum(unsettled.values()),
        )

    def close(self) -> None:
        """Fail what is in flight (telling peers), stop every thread, close every socket. Idempotent."""
        core = self._core
        with core.lock:
            if core.closed:
                return
            core.closed = True
            self._sender.close(FailReason.CLOSED.value)
            self._receiver.close(FailReason.CLOSED.value)
        assert core.control is not None
        core.control.close()
        core.plane.close()
        log.info("transfer agent %s closed", self._instance_id)

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._core.closed:
            raise RuntimeError("transfer agent is closed")
        if self._core.dead is not None:
            raise TransferError(self._core.dead)
