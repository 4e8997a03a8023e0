"""Router side of discovery: a thread that receives heartbeats and feeds the :class:`Registry`.

One ZeroMQ PULL socket bound on the discovery port; instances connect with
:class:`kvwire.discovery.HeartbeatClient` (PUSH). Malformed, unsigned (when a secret is set) or badly
signed messages are dropped and counted in ``dropped[reason]``; they never reach the registry. With a
secret, a signed message that is not fresh (a replay: its ``seq`` not after the last one of its
instance and epoch, or a first message outside the time window; :mod:`kvwire.router.freshness`) is
dropped too, as ``dropped["replayed"]``.

Fast failure detection: a socket monitor reports when a discovery TCP connection closes (the
instance process died: the kernel closes its sockets, kill -9 included). The listener remembers
which connection (file descriptor) each instance heartbeats on, and marks that instance unreachable
at once; its next heartbeat (if it is in fact alive and reconnected) brings it back. Silent failures
(host gone, network cut) are left to the TTL sweeper.
"""

from __future__ import annotations

import collections
import logging
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvwire.discovery.heartbeats import MAX_FRAME_BYTES, Deregister, Heartbeat, KvEvents, decode_frames
from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.http.refusal_log import RefusalLog
from kvwire.router.freshness import DEFAULT_MAX_ENTRIES, DEFAULT_WINDOW_S, FreshnessGuard
from kvwire.router.registry import ApplyResult, KvIndex, Registry
from kvwire.supervision import HealthBoard, SupervisedThread

log = logging.getLogger(__name__)

_POLL_MS = 100  # how often the thread checks for close()
_DRAIN_MAX = 10_000  # messages handled per wake-up at most (10 s of heartbeats from 1,000 instances)
_BATCH = 64  # heartbeats applied to the registry under one lock, with one update of its views
# After a wake-up the thread lets messages gather this long before it polls again. A wake-up costs
# 100-150 us of CPU on a VM whatever it finds, so at 1,000 heartbeats a second the listener wakes ~40
# times for ~25 messages each instead of once per message (decisions 108, 109). A registry update or
# a KV event is at most this much later: half the instances' KV-event tick, a fraction of a heartbeat
# interval, and inside the TTL's grace (2.5 intervals, decision 109).
_COALESCE_S = 0.025


class DiscoveryListener:
    """Binds ``tcp://host:port`` (port 0 = a free port) at construction; :meth:`start` runs the thread.

    The thread is a :class:`~kvwire.supervision.SupervisedThread` (``kvwire-discovery`` on ``board``):
    its loop is restartable (the sockets belong to the listener and are closed only by :meth:`close`),
    so a bug or a hostile message that gets past the decoder costs one restart, not discovery. ZeroMQ
    drops the connection of a peer sending a frame over ``MAX_FRAME_BYTES`` (``MAXMSGSIZE``) before
    buffering it; connections that close without having delivered one valid message are counted in
    :attr:`connections_dropped`.
    """

    def __init__(
        self, registry: Registry, host: str, port: int, secret: bytes | None = None,
        kv_index: KvIndex | None = None, *, board: HealthBoard | None = None,
        freshness_window_s: float = DEFAULT_WINDOW_S, freshness_max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self._registry = registry
        self._kv_index = kv_index  # KV events go there (dropped, counted, when None)
        self._secret = secret
        # replays are refused only where forging is (without a secret anyone can write a heartbeat)
        self.freshness = (FreshnessGuard(freshness_window_s, max_entries=freshness_max_entries)
                          if secret else None)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # per frame; bigger: connection dropped
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.address = f"tcp://{host}:{self.port}"
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._fd_owner: dict[int, tuple[str, int]] = {}  # connection fd -> (instance id, epoch)
        self.received: collections.Counter[str] = collections.Counter()  # by ApplyResult value
        self.dropped: collections.Counter[str] = collections.Counter()  # by reason
        # connections closed before one valid heartbeat (a frame over MAXMSGSIZE, a scan, a refused peer)
        self.connections_dropped = 0
        self._stop = threading.Event()
        self._refusals = RefusalLog(log, "discovery message")  # a flood logs once a minute per reason
        self._thread = SupervisedThread("kvwire-discovery", self._run, self._stop, board=board)

    def start(self) -> DiscoveryListener:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread, then close the sockets (idempotent; also when it never started)."""
        if self._thread.stop() and not self._ctx.closed:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        """The thread's loop until close(); raises on a failure (the supervisor restarts it)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_POLL_MS))
            # Messages first: a heartbeat an instance sent just before dying is queued before
            # its connection's close event; applied after it, it would bring the dead
            # instance back until the TTL. ZeroMQ queues a connection's messages before it
            # emits the event, so a full drain, then the events, keeps that order.
            drained = self._drain()
            if drained and self._monitor in events:
                self._on_monitor_events()
            if events and drained:
                self._stop.wait(_COALESCE_S)

    def _drain(self) -> bool:
        """Handle everything queued now, in arrival order: heartbeats and deregistrations in
        batches of ``_BATCH`` (one registry update each), KV events as they come (after the batch
        before them). False if it stopped at the bound (more is waiting)."""
        batch: list[tuple[Heartbeat | Deregister, int]] = []  # message, its connection's fd
        complete = False
        for _ in range(_DRAIN_MAX):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                complete = True
                break
            msg = self._decode(frames)
            if isinstance(msg, KvEvents):
                self._apply(batch)
                applied = self._kv_index is not None and self._registered(msg) and self._kv_index.apply(msg)
                self.received["kv_events" if applied else "kv_events_ignored"] += 1
            elif msg is not None:
                fd = frames[0].get(zmq.SRCFD)
                batch.append((msg, fd if isinstance(fd, int) else -1))
                if len(batch) >= _BATCH:
                    self._apply(batch)
        self._apply(batch)
        return complete

    def _decode(self, frames: list[zmq.Frame]) -> Heartbeat | Deregister | KvEvents | None:
        try:
            return self._fresh(decode_frames([f.bytes for f in frames], self._secret))
        except AuthenticationError as exc:
            self.dropped["unauthenticated"] += 1
            self._refusals.refused("unauthenticated", str(exc))
        except ProtocolError as exc:
            self.dropped["malformed"] += 1
            self._refusals.refused("malformed", str(exc))
        except Exception as exc:  # the decoder's contract is ProtocolError; a slip must not stop us
            self.dropped["malformed"] += 1
            self._refusals.refused("malformed", f"the decoder raised {type(exc).__name__}: {exc}")
        return None

    def _registered(self, msg: KvEvents) -> bool:
        """KV events count only for an instance the registry holds, at that epoch (its heartbeat goes
        first on every connection). Others' (a peer that never registered, one already forgotten)
        would each add state to the index that nothing removes, and every block size they name
        costs each request a pass over its prompt (``KvIndex.holders``)."""
        view = self._registry.get(msg.instance_id)
        return view is not None and view.info.epoch == msg.epoch

    def _fresh(self, msg: Heartbeat | Deregister | KvEvents) -> Heartbeat | Deregister | KvEvents | None:
        """``msg``, or None (counted, logged) when a secret is set and it is not fresh (a replay)."""
        if self.freshness is None:
            return msg
        ident, epoch = (msg.info.instance_id, msg.info.epoch) if isinstance(msg, Heartbeat) else (
            msg.instance_id, msg.epoch)
        refused = self.freshness.check(ident, epoch, msg.seq, msg.sent_at, self.freshness.window_s)
        if refused is None:
            return msg
        self.dropped["replayed"] += 1
        self._refusals.refused("replayed", refused)
        return None

    def _apply(self, batch: list[tuple[Heartbeat | Deregister, int]]) -> None:
        """Apply and empty ``batch``; remember which connection each live instance heartbeats on."""
        if not batch:
            return
        results = self._registry.apply_many([msg for msg, _ in batch])
        for (msg, fd), result in zip(batch, results, strict=True):
            self.received[result.value] += 1
            kept = result not in (ApplyResult.STALE, ApplyResult.REFUSED)
            if isinstance(msg, Heartbeat) and kept and fd >= 0:
                self._fd_owner[fd] = (msg.info.instance_id, msg.info.epoch)
        batch.clear()

    def _on_monitor_events(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            owner = self._fd_owner.pop(int(event["value"]), None)
            if owner is None:  # never delivered a valid heartbeat: a frame over MAXMSGSIZE, a scan
                self.connections_dropped += 1
            else:
                instance_id, epoch = owner
                self._registry.mark_unreachable(instance_id, epoch, "discovery connection closed")
