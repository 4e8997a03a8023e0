"""TCP data plane: raw sockets, one connection per (sender, receiver epoch) pair, zero-copy buffers.

Why raw sockets: on loopback ``sendall`` -> ``recv_into`` a preallocated buffer runs at about twice
the speed of ZMQ frames (docs/notes/ENVIRONMENT.md). The plane writes straight from the source
tensor's storage (a ``uint8`` memoryview, so bf16 needs no numpy dtype) and reads straight into the
posted destination buffer: no intermediate copy on either side.

Connection (sender connects to the receiver's ``address``)::

    receiver -> sender   nonce (16 random bytes)
    sender -> receiver   "KVWD" version:u8 src_len:u16 dst_len:u16 src_epoch dst_epoch
                         hmac_sha256(secret, nonce + all of the above)
    sender -> receiver   frames: layer:u32 num_bytes:u64 tid_len:u16 transfer_id payload...
                         (layer 0xFFFFFFFF, no payload, no id: the sender's heartbeat)
    receiver -> sender   one byte: the receiver's heartbeat

The MAC is 32 zero bytes when no secret is configured; with a secret, a bad MAC closes the connection.
``src_epoch`` is the sender's instance id, ``dst_epoch`` the one its control plane knows for the
receiver: the receiver takes the link only when the first is an epoch its own control plane holds now
and the second is its own (decision 126), so only the peer epochs the control plane authenticated hold
links, and frames match only receives posted for that epoch.
Every frame names its transfer and layer, so frames of many transfers interleave in any order
(``ordered = False``). Threads: one acceptor (supervised); per inbound connection a reader
(:mod:`~kvwire.transfer.planes.tcp.recv`) and a supervised reporter (runs the sinks); one writer per
peer (:mod:`~kvwire.transfer.planes.tcp.send`). Bounds and liveness (``config.links``, decision 115):
connections per listener and per peer address, the handshake deadline, kernel keepalive, heartbeats
both ways, and a deadline on every write.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from kvwire.supervision import HealthBoard
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.base import ListenerPlane
from kvwire.transfer.planes.common.admission import tcp_peer
from kvwire.transfer.planes.common.wire import CANCEL_WAIT_S, shutdown
from kvwire.transfer.planes.tcp.recv import TcpInbound
from kvwire.transfer.planes.tcp.send import TcpOutbound
from kvwire.transfer.planes.tcp.wire import tensor_bytes

__all__ = ["TcpPlane", "tensor_bytes"]


class TcpPlane(ListenerPlane[TcpOutbound]):
    """Raw-socket data plane for CPU tensors (CUDA tensors are staged through host memory).
    Listener, acceptor, close and cancelled ids:
    :class:`~kvwire.transfer.planes.base.ListenerPlane`."""

    ordered = False
    supports_spans = True
    early_grants = True  # a data frame must match its posted item's size
    link_kind = "tcp"

    def __init__(self, config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> None:
        super().__init__(config, instance_id, board)
        self.posted: dict[tuple[str, int], tuple[str, RecvItem]] = {}
        self.writing: dict[socket.socket, str] = {}  # connection -> transfer being written into spans
        self.written = threading.Condition(self.lock)
        self.bound_address = ""  # where we listen; ``address``: what peers dial (config.advertise_*)

    # --- lifecycle (start, close, accepting links: ListenerPlane) ------------------------------------

    def _open_listener(self) -> tuple[socket.socket, str]:
        listener = socket.create_server((self.config.host, self.config.data_port), backlog=128)
        host, port = listener.getsockname()[:2]
        self.bound_address = f"{host}:{port}"
        return listener, self.config.advertised(self.bound_address, self.config.advertise_data_port)

    def _peer(self, conn: socket.socket, addr: object) -> str:
        return tcp_peer(conn, addr)

    def _inbound_link(self, conn: socket.socket) -> TcpInbound:
        return TcpInbound(self, conn)

    def _closing_locked(self) -> None:
        self.posted.clear()

    # --- sender side ---------------------------------------------------------------------------------

    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        with self.lock:
            if self.closing.is_set():
                return
            out = self.outbound.get(peer.instance_id)
            if out is None or out.dead:
                out = TcpOutbound(self, peer)
                self.outbound[peer.instance_id] = out
                out.thread.start()
        for item in items:
            out.queue.put(item)

    def cancel(self, transfer_id: str) -> None:
        with self.lock:
            self._note_cancelled(transfer_id)
            for key in [k for k in self.posted if k[0] == transfer_id]:
                del self.posted[key]
            # A frame being written into the caller's memory (spans) must end before cancel returns:
            # the caller may reuse those blocks once the transfer failed. Bounded: then cut the link.
            finished = self.written.wait_for(
                lambda: transfer_id not in self.writing.values(), CANCEL_WAIT_S
            )
            conns = [] if finished else [c for c, t in self.writing.items() if t == transfer_id]
        for conn in conns:
            shutdown(conn)

    def drop_peer(self, peer_instance_id: str) -> None:
        with self.lock:
            out = self.outbound.pop(peer_instance_id, None)
            inbound = [s for s, pid in self.inbound.items() if pid == peer_instance_id]
            for key in [k for k, (pid, _) in self.posted.items() if pid == peer_instance_id]:
                del self.posted[key]
        if out is not None:
            out.stop()
        for sock in inbound:
            shutdown(sock)

    # --- receiver side -------------------------------------------------------------------------------

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        with self.lock:
            for item in items:
                self.posted[(item.transfer_id, item.layer_index)] = (peer.instance_id, item)
