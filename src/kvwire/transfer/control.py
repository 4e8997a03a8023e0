"""The agent's control thread: owns every ZMQ socket (ZMQ sockets are not thread-safe).

Inbound: one ROUTER bound at the agent's control endpoint. Outbound: one DEALER per peer endpoint,
created lazily (ZMQ reconnects it transparently when the peer restarts; epochs in the messages tell
old from new). Other threads hand work over through :meth:`send` / :meth:`call_soon`, which append to
an outbox and wake the thread through a socket pair; the thread never blocks on a peer (sends are
non-blocking, a full queue drops the message and logs: deadlines cover the loss).

Trust boundary (decision 116): ZeroMQ drops (and disconnects) a peer whose frame exceeds
``ControlLimits.max_message_bytes`` (``MAXMSGSIZE``); a message of more frames than the protocol has is
read part by part and dropped without keeping its extra parts; the codec checks sizes before any MAC
or decoding and turns whatever hostile bytes raise into a ProtocolError. The thread runs under a
:class:`~kvwire.supervision.SupervisedThread`: an exception in the handling of one message or one
outbound send is logged (rate-limited), counted on the board and the loop goes on; anything else that
escapes an iteration restarts the loop after a backoff, and too many such failures mark the component
dead (``on_dead``: the agent fails every transfer and refuses new ones). More than
``MAX_CONTAINED_ERRORS`` contained errors within ``CONTAINED_WINDOW_S`` count as one such failure.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

import zmq

from kvwire.errors import ProtocolError
from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.control_messages import MAX_FRAMES, AnyMsg, Codec
from kvwire.transfer.peer_watch import PeerWatch

log = logging.getLogger(__name__)

TICK_S = 0.02  # deadline/ack-flush granularity
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
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._outbox: collections.deque[tuple[str, AnyMsg] | Callable[[], None]] = collections.deque()
        self._stop = threading.Event()
        self._errors = _ErrorLog()
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

    def send(self, endpoint: str, msg: AnyMsg) -> None:
        with self._lock:
            self._outbox.append((endpoint, msg))
        self.wake()

    def call_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._outbox.append(fn)
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, flush the outbox, close every socket and the ZMQ context."""
        self._stop.set()
        self.wake()
        stopped = self._thread.stop(timeout_s)
        if stopped:  # the thread is gone: its sockets are ours now (final Aborts leave)
            try:
                self._drain_outbox()
            except Exception:
                log.exception("transfer control loop: flushing the outbox on close failed")
        if self._watch is not None:
            self._watch.close()
        for dealer in self._dealers.values():
            dealer.close(linger=LINGER_MS)
        self._dealers.clear()
        self._router.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

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
        while True:
            with self._lock:
                if not self._outbox:
                    return
                item = self._outbox.popleft()
            try:
                if callable(item):
                    item()
                else:
                    self._send_now(*item)
            except Exception:  # one bad endpoint (a peer's choice) or callback: the rest go on
                self._contained("sending a control message" if not callable(item) else "a queued call")

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
        dealer = self._dealer(endpoint)
        try:
            dealer.send_multipart(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning(
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
        log.exception("%s%s", text, more)
