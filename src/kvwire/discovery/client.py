"""Instance side of discovery: a small thread that heartbeats to the router.

Any host uses it: the kvwire server, the vLLM plugin, test mocks. It imports no torch.

Contract:
* :meth:`HeartbeatClient.start` starts one daemon thread that sends a :class:`Heartbeat` at once and
  then every ``interval_s`` seconds, with the load returned by ``load_fn`` (called on that thread;
  an exception there is logged and the heartbeat carries ``load=None``).
* Sends never block: a ZeroMQ PUSH socket with a small high-water mark; if the router is down the
  newest few heartbeats wait in the queue and the rest are dropped (counted in ``dropped``).
* KV events (optional ``kv_events`` log): every ``kv_events_interval_s`` the thread drains the
  log's coalesced changes into :class:`KvEvents` batches on the same socket (at most
  ``MAX_EVENT_BATCHES_PER_TICK`` per tick: a bounded rate). A batch that cannot be queued makes the
  log resync (the next batches say ``cleared`` and carry the whole cache), so a lost batch leaves
  the router's index stale for one tick, not forever.
* :meth:`close` (idempotent; also the context-manager exit) stops the thread, sends a
  :class:`Deregister` so the router drops this instance at once, and waits at most ``linger_s`` for
  it to leave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

import zmq

from kvwire.discovery.messages import (
    Deregister,
    DiscoveryMessage,
    Heartbeat,
    InstanceInfo,
    InstanceLoad,
    KvEvents,
    encode_frames,
)
from kvwire.errors import ConfigError
from kvwire.kv_events import KvEventLog

log = logging.getLogger(__name__)

LoadFn = Callable[[], InstanceLoad]
MAX_EVENT_BATCHES_PER_TICK = 4


def _secret_bytes(secret: str | bytes | None) -> bytes | None:
    if secret is None or secret in ("", b""):
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


class HeartbeatClient:
    """Registers ``info`` with the router at ``router_address`` ("tcp://host:port") and keeps it alive."""

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
    ) -> None:
        if not router_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"router address must look like tcp://host:port, got {router_address!r}")
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
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self.sent = 0  # messages handed to ZeroMQ
        self.dropped = 0  # messages dropped because the queue to the router was full

    def start(self) -> HeartbeatClient:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._run, name=f"kvwire-heartbeat-{self.info.instance_id}", daemon=True
        )
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
            self._thread.join(timeout=self._linger_s + 2.0)
            if self._thread.is_alive():
                log.warning("heartbeat thread of %s did not stop in time", self.info.instance_id)

    def __enter__(self) -> HeartbeatClient:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 4 if self._kv_events is None else 16)
        sock.setsockopt(zmq.LINGER, int(self._linger_s * 1000))
        try:
            sock.connect(self.router_address)
            next_beat = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat or self._wake.is_set():
                    self._wake.clear()
                    self._send(sock, self._heartbeat())
                    next_beat = now + self.interval_s
                self._send_kv_events(sock)
                wait_s = next_beat - time.monotonic()
                if self._kv_events is not None:
                    wait_s = min(wait_s, self._kv_events_interval_s)
                self._wake.wait(max(wait_s, 0.0))
            self._send(sock, self._deregister())
        except Exception:  # the thread must never die silently
            log.exception("heartbeat thread of %s failed", self.info.instance_id)
        finally:
            sock.close()  # waits up to LINGER for the deregistration to leave
            ctx.term()

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

    def _send_kv_events(self, sock: zmq.Socket) -> None:
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
            if not self._send(sock, msg):
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
