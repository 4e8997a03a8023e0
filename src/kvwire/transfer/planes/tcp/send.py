"""Sender half of the TCP data plane: one writer thread per peer epoch (see
:mod:`kvwire.transfer.planes.tcp.plane`).

The writer dials, proves the hello, then writes queued layers in order. Every write runs under the
socket's timeout (``links.link_timeout_s``: a write without progress that long cuts the link); while
idle it drains the receiver's heartbeats, sends its own every ``keepalive_s`` and cuts a link that
heard nothing for ``link_timeout_s`` (:mod:`kvwire.transfer.planes.common.liveness`).
"""

from __future__ import annotations

import queue
import select
import socket
from typing import TYPE_CHECKING

from kvwire.transfer.memory import PeerRef, SendItem
from kvwire.transfer.planes.base import fail_queued
from kvwire.transfer.planes.common.hello import prove_hello
from kvwire.transfer.planes.common.liveness import Heartbeat, tcp_keepalive
from kvwire.transfer.planes.common.outbound import OutboundLink
from kvwire.transfer.planes.common.wire import POLL_S, send_parts
from kvwire.transfer.planes.tcp.wire import (
    FRAME,
    MAGIC,
    PING_FRAME,
    VERSION,
    host_port,
    tensor_bytes,
    tune,
)

if TYPE_CHECKING:
    from kvwire.transfer.planes.tcp.plane import TcpPlane

_DRAIN_BYTES = 4096


class TcpOutbound(OutboundLink):
    """Writer thread for one peer epoch: connects, authenticates, writes queued layers in order."""

    kind = "tcp"

    def __init__(self, plane: TcpPlane, peer: PeerRef) -> None:
        self.plane = plane
        super().__init__(peer, plane.board)

    def _connect(self) -> socket.socket:
        links = self.plane.config.links
        sock = socket.create_connection(host_port(self.peer.data_address), timeout=links.handshake_timeout_s)
        self.sock = sock
        tune(sock, self.plane.config.socket_buffer_bytes)
        tcp_keepalive(sock, links)
        prove_hello(sock, self.plane.secret, self.plane.instance_id, self.peer.instance_id, MAGIC, VERSION)
        sock.settimeout(links.link_timeout_s)  # every write's deadline from here on
        return sock

    def _write_loop(self) -> None:
        cb = self.plane.callbacks
        sock = self._connect()
        what = f"tcp data link to {self.peer.data_address}"
        beat = Heartbeat(sock, self.plane.config.links, PING_FRAME, what)
        while not self.stopped.is_set():
            try:
                item = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                self._hear(sock, beat)
                beat.idle()
                continue
            if item is None:
                break
            if self.plane.is_cancelled(item.transfer_id):
                continue
            self._write(sock, item)
            beat.sent()
            cb.on_sent(self.peer.instance_id, item.transfer_id, (item.layer_index,))

    def _link(self) -> str:
        return f"data connection to {self.peer.data_address}"

    def _peer_failed(self, reason: str) -> None:
        self.plane.callbacks.on_peer_failed(self.peer.instance_id, reason)

    @staticmethod
    def _hear(sock: socket.socket, beat: Heartbeat) -> None:
        """Drain what the receiver wrote (heartbeats only); ConnectionError on EOF (peer gone)."""
        while select.select([sock], [], [], 0)[0]:
            if not sock.recv(_DRAIN_BYTES):
                raise ConnectionError("receiver closed the data connection")
            beat.heard()

    def _write(self, sock: socket.socket, item: SendItem) -> None:
        if item.ready_event is not None:
            item.ready_event.synchronize()
        if item.spans is not None:  # straight from the paged blocks: the kernel gathers
            base = tensor_bytes(item.spans.base)
            parts = [base[off : off + n] for off, n in item.spans.spans if n]
        else:
            tensor = item.tensor if item.tensor.device.type == "cpu" else item.tensor.cpu()
            parts = [tensor_bytes(tensor)]
        tid = item.transfer_id.encode()
        num_bytes = sum(len(p) for p in parts)
        send_parts(sock, [memoryview(FRAME.pack(item.layer_index, num_bytes, len(tid)) + tid), *parts])

    def _finish(self) -> None:
        plane = self.plane
        with plane.lock:
            self.dead = True
            if plane.outbound.get(self.peer.instance_id) is self:
                del plane.outbound[self.peer.instance_id]
        if self.sock is not None:
            self.sock.close()
        if not self.stopped.is_set():
            fail_queued(self.queue, plane.callbacks, "peer_lost: data connection closed")
