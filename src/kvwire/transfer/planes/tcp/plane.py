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

import contextlib
import socket
import threading
import time
from collections.abc import Sequence

from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.planes.admission import Admission, accept_loop, start_reader, tcp_peer
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks
from kvwire.transfer.planes.tcp.recv import TcpInbound
from kvwire.transfer.planes.tcp.send import TcpOutbound
from kvwire.transfer.planes.tcp.wire import CANCEL_MEMORY_S, CANCEL_WAIT_S, POLL_S, tensor_bytes
from kvwire.transfer.types import PeerRef, RecvItem, SendItem

__all__ = ["TcpPlane", "tensor_bytes"]

_JOIN_S = 5.0


class TcpPlane(DataPlane):
    """Raw-socket data plane for CPU tensors (CUDA tensors are staged through host memory)."""

    ordered = False
    supports_spans = True
    early_grants = True  # a data frame must match its posted item's size

    def __init__(self, config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> None:
        self.config = config
        self.instance_id = instance_id
        self.secret = config.secret
        self.board = board if board is not None else HealthBoard()
        self.admission = Admission("tcp", config.links, self.board)
        self.lock = threading.Lock()
        self.outbound: dict[str, TcpOutbound] = {}
        self.inbound: dict[socket.socket, str] = {}  # connection -> peer instance id ("" = handshaking)
        self.readers: set[threading.Thread] = set()
        self.posted: dict[tuple[str, int], tuple[str, RecvItem]] = {}
        self._cancelled: dict[str, float] = {}
        self.writing: dict[socket.socket, str] = {}  # connection -> transfer being written into spans
        self.written = threading.Condition(self.lock)
        self.closing = threading.Event()
        self._listener: socket.socket | None = None
        self._address = ""  # what peers dial (config.advertise_*); bound_address: where we listen
        self.bound_address = ""
        self._acceptor: SupervisedThread | None = None
        self._callbacks: PlaneCallbacks | None = None

    @property
    def callbacks(self) -> PlaneCallbacks:
        assert self._callbacks is not None, "start() first"
        return self._callbacks

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self, callbacks: PlaneCallbacks) -> None:
        self._callbacks = callbacks
        listener = socket.create_server((self.config.host, self.config.data_port), backlog=128)
        listener.settimeout(POLL_S)
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self.bound_address = f"{host}:{port}"
        self._address = self.config.advertised(self.bound_address, self.config.advertise_data_port)
        self._acceptor = SupervisedThread(
            "kvwire-tcp-accept",
            lambda: accept_loop(listener, self.admission, self.closing, tcp_peer, self._serve),
            self.closing,
            board=self.board,
        ).start()

    @property
    def address(self) -> str:
        assert self._address, "start() first"
        return self._address

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        with self.lock:
            outbound = list(self.outbound.values())
            inbound = list(self.inbound)
            self.posted.clear()
        for out in outbound:
            out.stop()
        for sock in inbound:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.stop(_JOIN_S)
        for out in outbound:
            out.thread.join(timeout=_JOIN_S)
        with self.lock:
            readers = list(self.readers)
        for reader in readers:
            reader.join(timeout=_JOIN_S)
        if self._listener is not None:
            self._listener.close()

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

    def is_cancelled(self, transfer_id: str) -> bool:
        with self.lock:
            return transfer_id in self._cancelled

    def cancel(self, transfer_id: str) -> None:
        now = time.monotonic()
        with self.lock:
            self._cancelled[transfer_id] = now
            if len(self._cancelled) > 4096:
                self._cancelled = {t: s for t, s in self._cancelled.items() if now - s < CANCEL_MEMORY_S}
            for key in [k for k in self.posted if k[0] == transfer_id]:
                del self.posted[key]
            # A frame being written into the caller's memory (spans) must end before cancel returns:
            # the caller may reuse those blocks once the transfer failed. Bounded: then cut the link.
            finished = self.written.wait_for(
                lambda: transfer_id not in self.writing.values(), CANCEL_WAIT_S
            )
            conns = [] if finished else [c for c, t in self.writing.items() if t == transfer_id]
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def drop_peer(self, peer_instance_id: str) -> None:
        with self.lock:
            out = self.outbound.pop(peer_instance_id, None)
            inbound = [s for s, pid in self.inbound.items() if pid == peer_instance_id]
            for key in [k for k, (pid, _) in self.posted.items() if pid == peer_instance_id]:
                del self.posted[key]
        if out is not None:
            out.stop()
        for sock in inbound:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # --- receiver side -------------------------------------------------------------------------------

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        with self.lock:
            for item in items:
                self.posted[(item.transfer_id, item.layer_index)] = (peer.instance_id, item)

    def _serve(self, conn: socket.socket) -> None:
        """Start the reader of a connection the admission took on (acceptor thread)."""
        start_reader(self, conn, "kvwire-tcp-recv", TcpInbound(self, conn).serve)
