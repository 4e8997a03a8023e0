"""The transfer agent: its control thread, its completion events, and its public API.

Read in order: :class:`ControlLoop` (the ZMQ control thread); :class:`EventBox` (what ``poll``
reports); :class:`TransferAgent`. Where what reaches the agent goes (control messages, ticks, plane
reports) is :class:`~kvwire.transfer.core.Routes`.

The control thread
------------------
The agent's control thread: owns every ZMQ socket (ZMQ sockets are not thread-safe).

Inbound: one ROUTER bound at the agent's control endpoint. Outbound: one DEALER per peer endpoint,
created lazily (ZMQ reconnects it transparently when the peer restarts; epochs in the messages tell
old from new). Other threads hand messages over by appending to its ``outbox`` (``Core.send``) and waking it
through a socket pair (``waker``); the thread never blocks on
a peer (sends are non-blocking, a full queue drops the message and logs: deadlines cover the loss).

Trust boundary (decision 116): ZeroMQ drops (and disconnects) a peer whose frame exceeds
``ControlLimits.max_message_bytes`` (``MAXMSGSIZE``); a message of more frames than the protocol has is
read part by part and dropped without keeping its extra parts; the codec checks sizes before any MAC
or decoding and turns whatever hostile bytes raise into a ProtocolError. The thread runs under a
:class:`~kvwire.supervision.SupervisedThread`: an exception in the handling of one message or one
outbound send is logged (rate-limited), counted on the board and the loop goes on; anything else that
escapes an iteration restarts the loop after a backoff, and too many such failures mark the component
dead (``on_dead``: the agent fails every transfer and refuses new ones). More than
``MAX_CONTAINED_ERRORS`` contained errors within ``CONTAINED_WINDOW_S`` count as one such failure.

Completion events
-----------------
What the halves report (sent, received, failed, with timings), appended by any thread and swapped
out at once by :meth:`TransferAgent.poll`.

The agent
---------
TransferAgent: one per process (per GPU worker); moves KV layers to/from peer agents.

Threads: the control thread (:class:`ControlLoop`: ZMQ I/O, message handling, deadlines,
ack flushing, delayed sink deliveries) and the data plane's threads (:mod:`kvwire.transfer.planes.base`);
what they report goes through :class:`~kvwire.transfer.core.Routes` to the side that holds the
transfer (:mod:`kvwire.transfer.sender`, the receive side in :mod:`kvwire.transfer.core`).
Caller threads only touch in-memory state under the agent lock and queue work: no public method
waits on the network. Completion is reported through :meth:`TransferAgent.poll`.

Leases: a transfer's ``deadline_s`` is a liveness lease (:mod:`kvwire.transfer.core`), renewed
while its peer shows life and never past ``limit_s`` (default ``config.default_limit_s``); both can
come from a client (``kv_transfer_params``): a larger value is cut to the agent's limit, never
trusted (decision 149).

Spans: a plane that supports them (TCP) sends straight from byte spans (``send_layer_spans``: no
gather copy; otherwise the agent gathers) and receives straight into them (``expect(scatter_into=...)``:
no buffer and no copy; others copy on arrival).

Failure model: every transfer has a deadline; expiry, ``abort``, a peer's Abort, a broken data
connection or a restarted peer (new instance id at the same endpoint) end it as FAILED with a reason
on this side and (where the peer is still reachable) on the other, and free what it held.

Supervision (decision 116): the control thread is a supervised component of ``board`` (the process's
:class:`~kvwire.supervision.HealthBoard`; ``agent.board``). If it fails too often it is dead: every
transfer in flight fails at once (``closed: ...``, seen in :meth:`TransferAgent.poll`), new ones are
refused with a TransferError, and the board (``/health``, ``kvwire_component_up``) names it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
import zmq

from kvwire.errors import ProtocolError, TransferError
from kvwire.http.refusal_log import RefusalLog
from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.buffers import RecvMemory
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.core import TICK_S, CompletionEvents, Core, Receiver, Routes, TransferStats
from kvwire.transfer.enums import FailReason, KVLayout
from kvwire.transfer.memory import (
    BlockTarget,
    ByteSpans,
    LayerSink,
    LayerSpec,
    PagedKV,
    PullSlice,
    TransferEvents,
)
from kvwire.transfer.peer_watch import PeerWatch
from kvwire.transfer.planes.base import DataPlane, PlaneSet
from kvwire.transfer.planes.factory import make_plane
from kvwire.transfer.sender import Sender
from kvwire.transfer.wire import MAX_FRAMES, AnyMsg, Codec

# ============================== The control thread

log = logging.getLogger("kvwire.transfer")
control_log = logging.getLogger("kvwire.transfer.control")  # the control thread's logger (its name kept)

MAX_BATCH = 256  # inbound messages handled per wake-up before the outbox gets a turn
SNDHWM = 10_000
LINGER_MS = 200  # give final Aborts a moment to leave on close
MAX_DEALERS = 512  # cached outbound sockets (one per peer endpoint)
# Nothing is ever read from an outbound DEALER (peers answer on our ROUTER): what a peer pushes back
# into one is capped at one small frame rather than queued unread.
DEALER_MAX_INBOUND_BYTES = 1024
NAME = "kvwire-transfer-control"
ERROR_LOG_INTERVAL_S = 10.0  # per-message / per-send errors: one traceback per interval, then counts
# Contained errors tolerated within the window; one more and the loop fails (the supervisor restarts
# it with backoff, and gives it up when that keeps happening): a handler that fails on message after
# message is broken, not unlucky, and the process must say so.
MAX_CONTAINED_ERRORS = 100
CONTAINED_WINDOW_S = 60.0


class ControlLoop:
    """Control-plane I/O thread. ``handler``/``on_reject``/``on_tick`` run on this thread.

    ``board``: the process's :class:`~kvwire.supervision.HealthBoard` (None: a private one);
    ``on_dead(exc)``: runs once, on this thread, when supervision gives the loop up;
    ``on_limit(name)``: a control-plane limit was hit (counted by the agent)."""

    def __init__(
        self,
        config: TransferConfig,
        handler: Callable[[AnyMsg], None],
        on_reject: Callable[[str], None],
        on_tick: Callable[[], None],
        on_unreachable: Callable[[str], None] | None = None,
        *,
        board: HealthBoard | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
        on_limit: Callable[[str], None] | None = None,
    ) -> None:
        """``on_unreachable(endpoint)``: a peer we send to refuses connections now (peer_watch)."""
        self._max_bytes = config.limits.max_message_bytes
        self._codec = Codec(config.secret, self._max_bytes)
        self._handler = handler
        self._on_reject = on_reject
        self._on_tick = on_tick
        self._on_limit = on_limit or (lambda _name: None)
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, SNDHWM)
        self._router.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)  # per frame; larger: peer disconnected
        self._router.bind(f"tcp://{config.host}:{config.control_port}")
        #: where the ROUTER listens; ``endpoint``: what peers are told to dial (config.advertise_*)
        self.bound_endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        bound = self.bound_endpoint.removeprefix("tcp://")
        self.endpoint: str = "tcp://" + config.advertised(bound, config.advertise_control_port)
        # outbound sockets by peer endpoint, least recently used first (bounded: peers come and go)
        self._dealers: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()
        self._wake_r, self.waker = socket.socketpair()  # ``waker``: a byte wakes the thread (any thread)
        self.waker.setblocking(False)
        self._wake_r.setblocking(False)
        # what the thread sends next, (endpoint, message); ``Core.send`` appends to it directly (a
        # deque's append and popleft are atomic; this thread is its one consumer)
        self.outbox: collections.deque[tuple[str, AnyMsg]] = collections.deque()
        self._stop = threading.Event()
        self._errors = _ErrorLog()
        self._refusals = RefusalLog(control_log, "control message")  # endpoints ZeroMQ refuses
        self._contained_at: collections.deque[float] = collections.deque()  # when, within the window
        self.board = board if board is not None else HealthBoard()
        self._thread = SupervisedThread(NAME, self._loop, self._stop, board=self.board, on_dead=on_dead)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self._watch = PeerWatch(self._poller, on_unreachable) if on_unreachable is not None else None

    def start(self) -> None:
        self._thread.start()

    # --- thread-safe entry points ----------------------------------------------------------------------

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self.waker.send(b"\0")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, flush the outbox, close every socket and the ZMQ context."""
        self._stop.set()
        self.wake()
        stopped = self._thread.stop(timeout_s)
        if stopped:  # the thread is gone: its sockets are ours now (final Aborts leave)
            try:
                self._drain_outbox()
            except Exception:
                control_log.exception("transfer control loop: flushing the outbox on close failed")
        if self._watch is not None:
            self._watch.close()
        for dealer in self._dealers.values():
            dealer.close(linger=LINGER_MS)
        self._dealers.clear()
        self._router.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self.waker.close()

    # --- the thread ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        """The supervised body: returns once ``stop`` is set. What one message or one send raises is
        contained where it happens; anything else propagates to the supervisor (restart, or dead)."""
        while not self._stop.is_set():
            ready = dict(self._poller.poll(int(TICK_S * 1000)))
            if self._router in ready:
                self._drain_inbound()
            if self._wake_r.fileno() in ready:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(65536)
            self._drain_outbox()
            if self._watch is not None:
                self._watch.handle(ready)
            self._on_tick()

    def _drain_inbound(self) -> None:
        for _ in range(MAX_BATCH):
            frames = self._recv_frames()
            if frames is None:
                return
            if not frames:
                continue  # refused (too many frames), already counted
            try:
                msg = self._codec.decode(frames)
            except ProtocolError as exc:
                if len(frames[0]) > self._max_bytes:
                    self._on_limit("control_message_bytes")
                self._on_reject(str(exc))
                continue
            try:
                self._handler(msg)
            except Exception:  # a bug one message triggers must not stop the others
                self._contained("handling a control message")

    def _recv_frames(self) -> list[bytes] | None:
        """One inbound message without its ROUTER identity frame; None when none is waiting; [] when
        it had more frames than the protocol (the rest read and dropped, never kept)."""
        try:
            self._router.recv(zmq.NOBLOCK)  # the peer's identity (ZMQ delivers a message's parts at once)
        except zmq.Again:
            return None
        frames: list[bytes] = []
        count = 0
        while self._router.getsockopt(zmq.RCVMORE):
            part = self._router.recv(zmq.NOBLOCK, copy=False)
            count += 1
            if count <= MAX_FRAMES:
                frames.append(part.bytes)
        if count > MAX_FRAMES or not frames:
            self._on_limit("control_frames")
            self._on_reject(f"control message of {count} frames (at most {MAX_FRAMES})")
            return []
        return frames

    def _drain_outbox(self) -> None:
        while self.outbox:
            endpoint, msg = self.outbox.popleft()
            try:
                self._send_now(endpoint, msg)
            except Exception:  # one bad endpoint (a peer's choice): the rest go on
                self._contained("sending a control message")

    def _contained(self, what: str) -> None:
        """Log (rate-limited, with the traceback) and count an error contained to one item; past
        ``MAX_CONTAINED_ERRORS`` within the window, fail the loop instead (the caller's exception
        context goes with it)."""
        self.board.worker_error(NAME)
        self._errors.log(f"transfer control loop: {what} failed (continuing)")
        now = time.monotonic()
        self._contained_at.append(now)
        while self._contained_at and self._contained_at[0] < now - CONTAINED_WINDOW_S:
            self._contained_at.popleft()
        if len(self._contained_at) > MAX_CONTAINED_ERRORS:
            self._contained_at.clear()
            raise RuntimeError(f"{what} failed more than {MAX_CONTAINED_ERRORS} times within "
                               f"{CONTAINED_WINDOW_S:.0f} s")

    def _dealer(self, endpoint: str) -> zmq.Socket:
        dealer = self._dealers.get(endpoint)
        if dealer is not None:
            self._dealers.move_to_end(endpoint)
            return dealer
        if len(self._dealers) >= MAX_DEALERS:
            gone, oldest = self._dealers.popitem(last=False)
            if self._watch is not None:
                self._watch.unwatch(gone, oldest)
            oldest.close(linger=0)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, LINGER_MS)
        dealer.setsockopt(zmq.SNDHWM, SNDHWM)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.MAXMSGSIZE, DEALER_MAX_INBOUND_BYTES)
        try:
            if self._watch is not None:
                self._watch.watch(endpoint, dealer)  # before connect: its first attempt counts too
            dealer.connect(endpoint)
        except zmq.ZMQError:
            if self._watch is not None:
                self._watch.unwatch(endpoint, dealer)
            dealer.close(linger=0)
            raise
        self._dealers[endpoint] = dealer
        return dealer

    def _send_now(self, endpoint: str, msg: AnyMsg) -> None:
        try:
            dealer = self._dealer(endpoint)
        except zmq.ZMQError as exc:  # an endpoint ZeroMQ refuses (a caller's or kv_transfer_params'
            self._on_limit("control_endpoint")  # choice): dropped like a full queue's, not a loop error
            self._refusals.refused("bad_endpoint", f"cannot send to {endpoint[:80]!r} ({exc})")
            return
        try:
            dealer.send_multipart(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            control_log.warning(
                "control queue to %s is full: dropped %s for %s",
                endpoint,
                type(msg).__name__,
                msg.transfer_id,
            )


class _ErrorLog:
    """One traceback per ``ERROR_LOG_INTERVAL_S``, then how many were not logged (a hostile peer that
    triggers an error per message must not flood the log). Control thread only."""

    def __init__(self) -> None:
        self._last = -ERROR_LOG_INTERVAL_S
        self._suppressed = 0

    def log(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last < ERROR_LOG_INTERVAL_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        self._last, self._suppressed = now, 0
        control_log.exception("%s%s", text, more)


# ============================== Completion events

class EventBox(CompletionEvents):
    """The completion events as :meth:`TransferAgent.poll` and :meth:`TransferAgent.wait` read them:
    the halves append (:class:`~kvwire.transfer.core.CompletionEvents`, any thread), the caller of
    ``poll`` swaps them out atomically."""

    def wait(self, timeout_s: float) -> bool:
        """Block until an event is waiting to be swapped out, at most ``timeout_s``; True if one is."""
        with self._lock:
            return self._ready.wait_for(lambda: bool(self._sent or self._recvd or self._failed), timeout_s)

    def swap(self) -> TransferEvents:
        with self._lock:
            sent, recvd, failed, timings = self._sent, self._recvd, self._failed, self._timings
            self._sent, self._recvd, self._failed, self._timings = set(), set(), {}, {}
        return TransferEvents(frozenset(sent), frozenset(recvd), failed, timings)


# ============================== The agent


def _assemble(
    config: TransferConfig, instance_id: str, plane: DataPlane, events: EventBox, board: HealthBoard
) -> tuple[Core, Sender, Receiver, Routes]:
    """The agent's parts over its data plane: the core (with its receive memory), both sides, the
    routes (control messages, ticks and plane reports go to the side holding the transfer they
    name), the plane started and the control thread started (the plane closed if that fails)."""
    pinned = config.device.startswith("cuda")
    mem = RecvMemory(config.recv_budget_bytes, config.spill_budget_bytes, plane.allocate, pinned=pinned)
    core = Core(config, instance_id, plane, mem, events)
    sender, receiver = Sender(core), Receiver(core)
    routes = Routes(core, sender, receiver)
    plane.start(routes)
    try:
        core.control = ControlLoop(
            config, routes.on_message, routes.on_reject, routes.on_tick, routes.on_unreachable,
            board=board, on_dead=routes.on_control_dead, on_limit=core.stats.limit_hit,
        )  # fmt: skip
    except BaseException:
        plane.close()
        raise
    core.control.start()
    bound = core.control.bound_endpoint
    via = "" if bound == core.endpoint else f", listening at {bound}"
    log.info("transfer agent %s at %s (data %s%s)", instance_id, core.endpoint, plane.address, via)
    return core, sender, receiver, routes


def _bounds(config: TransferConfig, deadline_s: float | None, limit_s: float | None) -> tuple[float, float]:
    """A transfer's lease and overall bound: the caller's, within this agent's own limit
    (``config.default_limit_s``). Both can come from a client (``kv_transfer_params``): a larger
    value is cut to the limit, never trusted (decision 149)."""
    cap = config.default_limit_s
    deadline = config.default_deadline_s if deadline_s is None else min(deadline_s, cap)
    return deadline, cap if limit_s is None else min(limit_s, cap)


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
        self._planes = plane_factory(config, self._instance_id, self.board)
        self._events = EventBox()  # the halves append through core.events; poll swaps them out
        self._core, self._sender, self._receiver, self._routes = _assemble(
            config, self._instance_id, self._planes, self._events, self.board
        )

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
        agent then moves blocks the plane's fastest way (``kvwire.transfer.memory``). The tensors
        must stay allocated for the agent's life."""
        paged = PagedKV(kv_caches, layout)
        with self._core.lock:
            self._check_open()
            self._paged = paged
        self._planes.register_memory(paged.layers)  # e.g. shared-memory caches: exported to peers

    def block_layers(self, num_blocks: int, heads: range | None = None) -> list[LayerSpec]:
        """The layer specs of a transfer of ``num_blocks`` blocks of every registered layer (only KV
        ``heads`` of each block, when given)."""
        paged = self._registered(heads)
        return [paged.spec(index, num_blocks) for index in range(paged.num_layers)]

    def _registered(self, heads: range | None = None) -> PagedKV:
        """The registered caches, restricted to KV ``heads`` when given (no call into them otherwise:
        the whole caches are the common case on a request's path)."""
        if self._paged is None:
            raise TransferError("register_kv_caches first")
        return self._paged if heads is None else self._paged.heads(heads)

    # --- send side ---------------------------------------------------------------------------------------

    def start_send(
        self, transfer_id: str, peer_endpoint: str | None, layers: Sequence[LayerSpec], *,
        deadline_s: float | None = None, with_trailer: bool = False,
        pull_by: str | Sequence[str] | None = None, limit_s: float | None = None,
    ) -> None:  # fmt: skip
        """Announce a transfer to ``peer_endpoint`` (one Offer message), or hold it for a pull
        (``peer_endpoint`` None: lease until the deadline). Never blocks on the network.
        ``pull_by``: the control endpoint(s) allowed to pull it (others are refused and counted in
        ``offers_refused``); None: the first puller. A held transfer of blocks (:meth:`send_blocks`)
        may also be pulled in pieces, a head range each (``expect(pull_slice=...)``).
        ``deadline_s``: the lease (module docstring), renewed while the receiver shows life.
        ``transfer_id``: caller-given, unique (e.g. a uuid minted by the router); do not reuse an id
        for a new transfer between the same agents (ended ids are remembered to reject late messages)."""
        with self._core.lock:
            self._check_open()
            deadline, limit = _bounds(self.config, deadline_s, limit_s)
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
            deadline, limit = _bounds(self.config, deadline_s, limit_s)
            started = transfer_id in self._sender.table
            # nothing to wake the control loop for: the first Renew is not due yet (its ticks send it)
            self._sender.promises.promise(transfer_id, peer_endpoint, deadline, limit, started)

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
        cache: ``paged.block_spans(kv, block_ids, layout)``; spans: module docstring). The bytes must
        not change until the transfer ends."""
        with self._core.lock:
            self._check_open()
            self._sender.add_layer_spans(transfer_id, layer_index, spans, ready_event)

    def send_blocks(
        self, transfer_id: str, layer_index: int, block_ids: torch.Tensor, ready_event: Any | None = None,
        heads: range | None = None,
    ) -> None:  # fmt: skip
        """Hand over one layer as blocks ``block_ids`` (int64, in token order; on the caches' device
        for GPU caches) of the registered caches — the serving path. ``ready_event``: a CUDA event
        recorded after the layer's KV was written. ``heads``: only these KV heads of each block (a
        tensor-parallel peer's share). The blocks must not change until the transfer ends. No-op if
        the transfer already failed."""
        paged = self._registered(heads)
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
        self, transfer_id: str, *, num_layers: int, sink: LayerSink | None = None,
        deadline_s: float | None = None, pull_from: str | None = None,
        scatter_into: Callable[[int], ByteSpans] | None = None, into_blocks: BlockTarget | None = None,
        accept_from: str | None = None, sender: str | None = None, limit_s: float | None = None,
        pull_slice: PullSlice | None = None,
    ) -> None:  # fmt: skip
        """Announce an incoming transfer (before or after its data arrives). ``sink(index, tensor)``
        runs on a transfer thread per layer (tensor valid during the call only); without a sink the
        layers are buffered for :meth:`take_layers`. ``pull_from``: ask that sender (pull mode).

        ``scatter_into(index) -> ByteSpans`` (instead of a sink): where layer ``index``'s bytes go,
        e.g. ``paged.block_spans(kv_cache[index], block_ids, layout)`` (spans: module docstring).
        Called under the agent lock when a layer is granted: must be cheap and must not call the
        agent. The spans must stay valid until the transfer ends (finished or failed).

        ``into_blocks`` (the serving path; :meth:`register_kv_caches` first): every layer lands in
        those blocks of its registered cache, the plane's fastest way — in place where the payload
        fits the blocks exactly, else through a copy that skips/drops blocks (see ``registered_caches``). The
        blocks must not be reused until the transfer ended; once it failed (or an abort of it
        returned) and it is not in :meth:`unsettled`, nothing of it writes into them any more.

        ``accept_from`` (default ``pull_from``): the sender's control endpoint; offers of this id from
        any other agent are refused (counted in ``offers_refused``), so a third agent that knows the
        id cannot inject data. Raises TransferError if another agent offered it already, or if its
        Offer came and was dropped, not expected within ``max_unsolicited_wait_s`` (decision 159).

        ``deadline_s`` is a liveness lease: renewed while the sender (``pull_from``, the Offer's
        sender, or ``sender``: push mode's sender endpoint when known in advance) shows life, so a
        slow but alive sender (prefill queued) does not fail it; never past ``limit_s``.

        ``pull_slice`` (with ``pull_from``): pull one piece of a transfer the sender holds for several
        receivers (its ``held_id``; ``transfer_id`` is this piece's own id), only the KV heads it names."""
        if sum(x is not None for x in (sink, scatter_into, into_blocks)) > 1:
            raise ValueError("expect: give at most one of sink, scatter_into, into_blocks")
        target = None if into_blocks is None else (self._registered(into_blocks.heads), into_blocks)
        deadline, limit = _bounds(self.config, deadline_s, limit_s)
        with self._core.lock:
            self._check_open()
            deliver = self._receiver.expect(
                transfer_id, num_layers, sink, deadline, pull_from, scatter_into, target, accept_from,
                sender, limit, pull_slice,
            )  # fmt: skip
        if deliver:  # the control thread hands the layers buffered so far to the sink
            self._core.wake()

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
            return self._receiver.arrivals.take_layers(transfer_id)

    def take_trailer(self, transfer_id: str) -> bytes | None:
        """The trailer of a transfer in ``finished_recving``, once (None if none came)."""
        with self._core.lock:
            return self._receiver.arrivals.take_trailer(transfer_id)

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
            self._receiver.arrivals.drop_done(transfer_id)

    def unsettled(self) -> dict[str, int]:
        """Failed or aborted receives whose sender may still write into their destinations (a
        stalled shared-memory sender kept its grant past the revoke wait: decision 114), with the
        bytes each covers. Reuse a receive's blocks only once it is absent here; a transfer leaves
        this map when its sender let go of the grant or its process ended. Any thread."""
        return self._core.plane.unsettled()

    def poll(self, trailers: bool = False) -> TransferEvents:
        """Events since the last poll, swapped out atomically; each transfer id is reported once.
        ``trailers``: the events also carry the trailers of the transfers in ``finished_recving``
        that came with one (taken: :meth:`take_trailer` returns None for those afterwards), so a
        caller that reads them makes one call per step."""
        events = self._events.swap()
        if trailers and events.finished_recving:
            with self._core.lock:
                done = self._receiver.arrivals.done_trailers
                events.trailers.update((t, done.pop(t)) for t in events.finished_recving if t in done)
        return events

    def wait(self, timeout_s: float) -> bool:
        """Block until :meth:`poll` has an event to report, at most ``timeout_s`` seconds; True if
        it has. For a caller with nothing else to do (a benchmark, an idle engine loop): it sleeps
        instead of polling in a loop, which costs a core's time in wake-ups."""
        return self._events.wait(timeout_s)

    def wake_on_completion(self, wake: Callable[[], None] | None) -> None:
        """Call ``wake()`` each time a receive ends or a transfer fails (on the thread that learned
        it: the control thread or a plane's, most often with the agent's lock held), so that a host
        waiting to :meth:`poll` polls now: the built-in server's engine loop (decision 153). ``wake``
        must be quick, must not raise and must not wait for another thread (one that calls this
        agent would wait for its lock). None: no call."""
        self._events.listener = wake

    def stats(self) -> TransferStats:
        core = self._core
        with core.lock:
            active = len(self._sender.table) + len(self._receiver.table)
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
