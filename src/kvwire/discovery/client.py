"""Instance side of discovery: a small thread that heartbeats to the router.

Any host uses it: the kvwire server, the vLLM plugin, test mocks. It imports no torch.

Contract:
* :meth:`HeartbeatClient.start` starts one daemon thread that sends a :class:`Heartbeat` at once (or,
  with ``wait_for_http``, as soon as the instance's HTTP server answers at ``info.url``: a router must
  not route to an instance that refuses connections) and then every ``interval_s`` seconds, with
  the load returned by ``load_fn`` (called on that thread; an exception there is logged and the
  heartbeat carries ``load=None``).
* Sends never block: a ZeroMQ PUSH socket with a small high-water mark; if the router is down the
  newest few heartbeats wait in the queue and the rest are dropped (counted in ``dropped``).
* KV events (optional ``kv_events`` log): every ``kv_events_interval_s`` the thread drains the
  log's coalesced changes into :class:`KvEvents` batches on the same socket (at most
  ``MAX_EVENT_BATCHES_PER_TICK`` per tick: a bounded rate). A batch that cannot be queued makes the
  log resync (the next batches say ``cleared`` and carry the whole cache), so a lost batch leaves
  the router's index stale for one tick, not forever.
* A new discovery connection (a router started after this instance, or restarted: ZeroMQ
  reconnects by itself) makes the thread send a heartbeat at once and resync the log, so the
  router's index is rebuilt from a full snapshot of this instance's cache (sent in the same bounded
  batches, the first one ``cleared``: it replaces whatever the router held for this instance).
  Counted in ``connections``.
* The thread is supervised (``kvwire-heartbeat`` on the host's ``board``, its ``/health``): an
  exception restarts it with backoff on fresh sockets (it registers again at once); one that keeps
  failing is dead, and the host answers ``/health`` with 503 naming it, instead of serving on
  unregistered and unaware.
* :meth:`close` (idempotent; also the context-manager exit) stops the thread, sends a
  :class:`Deregister` so the router drops this instance at once, and waits at most ``linger_s`` for
  it to leave.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from types import TracebackType

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvwire.discovery.heartbeats import (
    MAX_FRAME_BYTES,
    Deregister,
    DiscoveryMessage,
    Heartbeat,
    InstanceInfo,
    InstanceLoad,
    KvEvents,
    encode_frames,
)
from kvwire.errors import ConfigError
from kvwire.protocol.kv_blocks import KvEventLog
from kvwire.supervision import HealthBoard, SupervisedThread

log = logging.getLogger(__name__)

LoadFn = Callable[[], InstanceLoad]
MAX_EVENT_BATCHES_PER_TICK = 4

HTTP_PROBE_INTERVAL_S = 0.2
HTTP_PROBE_TIMEOUT_S = 1.0


def http_answers(url: str, timeout_s: float = HTTP_PROBE_TIMEOUT_S) -> bool:
    """True when an HTTP server answers at ``url`` (``GET url/health``; any HTTP status counts)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, with an error status: it is serving HTTP
    except (OSError, ValueError):
        return False


def _secret_bytes(secret: str | bytes | None) -> bytes | None:
    if secret is None or secret in ("", b""):
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def router_addresses(router_address: str) -> list[str]:
    """The routers of a ``router_address``: one ``tcp://host:port``, or several separated by commas
    (router high availability: every heartbeat goes to each of them)."""
    return [part.strip() for part in router_address.split(",") if part.strip()]


class HeartbeatClient:
    """Registers ``info`` with the router(s) at ``router_address`` ("tcp://host:port", or several
    separated by commas: each gets every message) and keeps it alive."""

    def __init__(
        self,
        router_address: str,
        info: InstanceInfo,
        load_fn: LoadFn | None = None,
        interval_s: float = 2.0,
        secret: str | bytes | None = None,
        linger_s: float = 0.5,
        kv_events: KvEventLog | None = None,
        kv_events_interval_s: float = 0.05,
        wait_for_http: bool = False,
        *,
        board: HealthBoard | None = None,
    ) -> None:
        addresses = router_addresses(router_address)
        if not addresses or not all(a.startswith(("tcp://", "ipc://", "inproc://")) for a in addresses):
            raise ConfigError(f"router address must look like tcp://host:port, got {router_address!r}")
        self.routers = addresses
        if interval_s <= 0:
            raise ConfigError(f"heartbeat interval_s must be > 0, got {interval_s}")
        self.router_address = router_address
        self.info = info
        self.interval_s = interval_s
        if kv_events_interval_s <= 0:
            raise ConfigError(f"kv_events_interval_s must be > 0, got {kv_events_interval_s}")
        self._kv_events = kv_events
        self._kv_events_interval_s = kv_events_interval_s
        self._load_fn = load_fn
        self._secret = _secret_bytes(secret)
        self._linger_s = linger_s
        self._wait_for_http = wait_for_http
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._board = board
        self._thread: SupervisedThread | None = None
        self._http_answered = not wait_for_http  # once true, a restarted body does not wait again
        self._seq = 0
        self.sent = 0  # messages handed to ZeroMQ
        self.dropped = 0  # messages dropped because the queue to the router was full
        self.connections = 0  # discovery connections established (each triggers a KV snapshot)

    def start(self) -> HeartbeatClient:
        if self._thread is not None:
            return self
        self._thread = SupervisedThread("kvwire-heartbeat", self._run, self._stop, board=self._board)
        self._thread.start()
        return self

    def send_now(self) -> None:
        """Ask the thread to send a heartbeat now (e.g. after a big load change)."""
        self._wake.set()

    def close(self) -> None:
        """Stop heartbeating and deregister (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.stop(timeout_s=self._linger_s + 2.0)  # logs when it did not stop in time

    def __enter__(self) -> HeartbeatClient:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        """The thread's body (a :class:`~kvwire.supervision.SupervisedThread`): its own sockets,
        closed on the way out; an exception is restarted with backoff (new sockets, which register
        again at once), and a thread that keeps failing is dead: the host's ``/health`` says so."""
        ctx = zmq.Context()
        socks = []  # one PUSH per router: a PUSH connected to several peers would round-robin
        monitors: list[zmq.Socket] = []  # each socket's connections (a router (re)started)
        try:
            for address in self.routers:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 4 if self._kv_events is None else 16)
                sock.setsockopt(zmq.LINGER, int(self._linger_s * 1000))
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a PUSH reads nothing; bound it anyway
                socks.append(sock)
                monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
                sock.connect(address)
            if not self._http_answered and not self._await_http():
                return  # closed before the server answered: never registered, nothing to deregister
            self._http_answered = True
            self._beat(socks, monitors)
            self._send_all(socks, self._deregister())
        finally:
            for sock, monitor in zip(socks, monitors, strict=False):
                sock.disable_monitor()
                monitor.close(linger=0)
            for sock in socks:
                sock.close()  # waits up to LINGER for the deregistration to leave
            ctx.term()

    def _beat(self, socks: list[zmq.Socket], monitors: list[zmq.Socket]) -> None:
        """Heartbeats and KV events until close()."""
        next_beat = 0.0
        while not self._stop.is_set():
            if self._new_connections(monitors):
                next_beat = 0.0  # a (re)started router: register at once, then the snapshot
            now = time.monotonic()
            if now >= next_beat or self._wake.is_set():
                self._wake.clear()
                self._send_all(socks, self._heartbeat())
                next_beat = now + self.interval_s
            self._send_kv_events(socks)
            wait_s = next_beat - time.monotonic()
            if self._kv_events is not None:
                wait_s = min(wait_s, self._kv_events_interval_s)
            self._wake.wait(max(wait_s, 0.0))

    def _new_connections(self, monitors: list[zmq.Socket]) -> bool:
        """True when a discovery connection was (re)established since the last call; then the KV
        log resyncs: its next batches carry a full snapshot, the first one ``cleared``."""
        connected = 0
        for monitor in monitors:
            while True:
                try:
                    recv_monitor_message(monitor, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                connected += 1
        if not connected:
            return False
        self.connections += connected
        if self._kv_events is not None:
            self._kv_events.resync()
        return True

    def _send_all(self, socks: list[zmq.Socket], msg: DiscoveryMessage) -> None:
        for sock in socks:
            self._send(sock, msg)

    def _await_http(self) -> bool:
        """Wait (until close) for the instance's HTTP server to answer. False if closed first."""
        logged = False
        while not self._stop.is_set():
            if http_answers(self.info.url):
                return True
            if not logged:
                log.info("%s: waiting for %s to answer before registering", self.info.instance_id,
                         self.info.url)
                logged = True
            self._stop.wait(HTTP_PROBE_INTERVAL_S)
        return False

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _heartbeat(self) -> Heartbeat:
        load: InstanceLoad | None = None
        if self._load_fn is not None:
            try:
                load = self._load_fn()
            except Exception:
                log.exception("load_fn of %s raised; heartbeat carries no load", self.info.instance_id)
        return Heartbeat(info=self.info, load=load, seq=self._next_seq(), sent_at=time.time())

    def _deregister(self) -> Deregister:
        return Deregister(
            instance_id=self.info.instance_id,
            epoch=self.info.epoch,
            seq=self._next_seq(),
            sent_at=time.time(),
        )

    def _send_kv_events(self, socks: list[zmq.Socket]) -> None:
        """Drain the KV event log into batches for every router (each keeps its own index); a batch
        any router could not take makes the log resend everything (resync)."""
        log_ = self._kv_events
        if log_ is None:
            return
        for _ in range(MAX_EVENT_BATCHES_PER_TICK):
            batch = log_.drain()
            if batch is None:
                return
            msg = KvEvents(
                instance_id=self.info.instance_id, epoch=self.info.epoch, block_size=batch.block_size,
                stored=batch.stored, removed=batch.removed, cleared=batch.cleared,
                num_cached_blocks=batch.num_cached_blocks, seq=self._next_seq(), sent_at=time.time(),
            )
            if not all([self._send(sock, msg) for sock in socks]):
                log_.resync()
                return

    def _send(self, sock: zmq.Socket, msg: DiscoveryMessage) -> bool:
        try:
            sock.send_multipart(encode_frames(msg, self._secret), flags=zmq.NOBLOCK)
            self.sent += 1
            return True
        except zmq.Again:
            self.dropped += 1
            return False
