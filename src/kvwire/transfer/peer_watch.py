"""Notice a peer process that is gone from its outbound control connection (docs/decisions/088).

Each outbound DEALER (one per peer endpoint) gets a ZMQ socket monitor. A peer whose process dies
(killed, crashed, its agent closed) closes its end: ZMQ reports the connection ``DISCONNECTED`` and
then tries to reconnect. A reconnect that fails (``CLOSED`` before any ``CONNECTED``: on a host
that is up, nothing listens at that port any more, so the kernel refused it) makes the endpoint
*unreachable*: the agent fails that peer's transfers at once (``peer_lost``) instead of waiting for
their leases. A first connection that is refused counts the same. A partition (no reset, no
refusal: connects just hang) is left to the leases, as before; a peer that answers again (a
restart at the same endpoint: ``CONNECTED``) re-arms the watch (epochs in the messages tell the new
process from the old). Control thread only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
MAX_EVENTS = 64  # monitor events handled per wake-up and socket


@dataclasses.dataclass
class _Watch:
    endpoint: str
    up: bool = False
    reported: bool = False


class PeerWatch:
    """Monitors of the outbound sockets; calls ``on_unreachable(endpoint)`` once per outage."""

    def __init__(self, poller: zmq.Poller, on_unreachable: Callable[[str], None]) -> None:
        self._poller = poller
        self._on_unreachable = on_unreachable
        self._watches: dict[zmq.Socket, _Watch] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # endpoint -> its monitor

    def watch(self, endpoint: str, dealer: zmq.Socket) -> None:
        monitor = dealer.get_monitor_socket(EVENTS)
        self._poller.register(monitor, zmq.POLLIN)
        self._watches[monitor] = _Watch(endpoint)
        self._monitors[endpoint] = monitor

    def unwatch(self, endpoint: str, dealer: zmq.Socket) -> None:
        """Before closing ``dealer`` (evicted, or the loop ends): its events mean nothing then."""
        monitor = self._monitors.pop(endpoint, None)
        if monitor is None:
            return
        self._poller.unregister(monitor)
        del self._watches[monitor]
        with contextlib.suppress(zmq.ZMQError):
            dealer.disable_monitor()
        monitor.close(linger=0)

    def handle(self, ready: dict[object, int]) -> None:
        for sock in ready:  # the few sockets with events, not every watched one
            if isinstance(sock, zmq.Socket) and (watch := self._watches.get(sock)) is not None:
                self._drain(sock, watch)

    def _drain(self, monitor: zmq.Socket, watch: _Watch) -> None:
        for _ in range(MAX_EVENTS):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                watch.up, watch.reported = True, False
            elif event == zmq.EVENT_DISCONNECTED:
                watch.up = False
            elif event == zmq.EVENT_CLOSED and not watch.up and not watch.reported:
                watch.reported = True  # a connect attempt failed: nothing listens there now
                log.debug("transfer peer %s refuses connections", watch.endpoint)
                self._on_unreachable(watch.endpoint)

    def close(self) -> None:
        for monitor in self._watches:
            monitor.close(linger=0)
        self._watches.clear()
        self._monitors.clear()
