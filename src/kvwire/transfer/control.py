"""The agent's control thread: owns every ZMQ socket (ZMQ sockets are not thread-safe).

Inbound: one ROUTER bound at the agent's control endpoint. Outbound: one DEALER per peer endpoint,
created lazily (ZMQ reconnects it transparently when the peer restarts; epochs in the messages tell
old from new). Other threads hand work over through :meth:`send` / :meth:`call_soon`, which append to
an outbox and wake the thread through a socket pair; the thread never blocks on a peer (sends are
non-blocking, a full queue drops the message and logs: deadlines cover the loss).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
from collections.abc import Callable

import zmq

from kvwire.errors import ProtocolError
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.messages import AnyMsg, Codec
from kvwire.transfer.peer_watch import PeerWatch

log = logging.getLogger(__name__)

TICK_S = 0.02  # deadline/ack-flush granularity
MAX_BATCH = 256  # inbound messages handled per wake-up before the outbox gets a turn
SNDHWM = 10_000
LINGER_MS = 200  # give final Aborts a moment to leave on close
MAX_DEALERS = 512  # cached outbound sockets (one per peer endpoint)


class ControlLoop:
    """Control-plane I/O thread. ``handler``/``on_reject``/``on_tick`` run on this thread."""

    def __init__(
        self,
        config: TransferConfig,
        handler: Callable[[AnyMsg], None],
        on_reject: Callable[[str], None],
        on_tick: Callable[[], None],
        on_unreachable: Callable[[str], None] | None = None,
    ) -> None:
        """``on_unreachable(endpoint)``: a peer we send to refuses connections now (peer_watch)."""
        self._codec = Codec(config.secret)
        self._handler = handler
        self._on_reject = on_reject
        self._on_tick = on_tick
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, SNDHWM)
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
        self._thread = threading.Thread(target=self._run, name="kvwire-transfer-control", daemon=True)
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
        """Flush the outbox, stop the thread, close every socket and the ZMQ context."""
        self._stop.set()
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
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

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
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
            except Exception:  # the loop must survive a bug in one handler
                log.exception("transfer control loop: unexpected error (continuing)")
        self._drain_outbox()

    def _drain_inbound(self) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._codec.decode(frames[1:])  # frame 0: the ROUTER's peer identity
            except ProtocolError as exc:
                self._on_reject(str(exc))
                continue
            self._handler(msg)

    def _drain_outbox(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                item = self._outbox.popleft()
            if callable(item):
                item()
            else:
                self._send_now(*item)

    def _send_now(self, endpoint: str, msg: AnyMsg) -> None:
        dealer = self._dealers.get(endpoint)
        if dealer is not None:
            self._dealers.move_to_end(endpoint)
        else:
            if len(self._dealers) >= MAX_DEALERS:
                gone, oldest = self._dealers.popitem(last=False)
                if self._watch is not None:
                    self._watch.unwatch(gone, oldest)
                oldest.close(linger=0)
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, LINGER_MS)
            dealer.setsockopt(zmq.SNDHWM, SNDHWM)
            if self._watch is not None:
                self._watch.watch(endpoint, dealer)  # before connect: its first attempt counts too
            dealer.connect(endpoint)
            self._dealers[endpoint] = dealer
        try:
            dealer.send_multipart(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning(
                "control queue to %s is full: dropped %s for %s",
                endpoint,
                type(msg).__name__,
                msg.transfer_id,
            )
