"""TCP data plane: raw sockets, one connection per (sender, receiver epoch) pair, zero-copy buffers.

Why raw sockets: on loopback ``sendall`` -> ``recv_into`` a preallocated buffer runs at about twice
the speed of ZMQ frames (docs/notes/ENVIRONMENT.md). The plane writes straight from the source
tensor's storage (a ``uint8`` memoryview, so bf16 needs no numpy dtype) and reads straight into the
posted destination buffer: no intermediate copy on either side.

Connection (sender connects to the receiver's ``address``)::

    receiver -> sender   nonce (16 random bytes)
    sender -> receiver   "KVWD" version:u8 id_len:u16 instance_id hmac_sha256(secret, nonce+id)
    sender -> receiver   frames: layer:u32 num_bytes:u64 tid_len:u16 transfer_id payload...

The MAC is 32 zero bytes when no secret is configured; with a secret, a bad MAC closes the connection.
Every frame names its transfer and layer, so frames of many transfers interleave in any order
(``ordered = False``). Threads: one acceptor; per inbound connection a reader and a reporter (runs the
sinks); one writer per peer.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Sequence

import torch

from kvwire.errors import ProtocolError
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks, fail_queued
from kvwire.transfer.planes.outbound import OutboundLink
from kvwire.transfer.planes.tcp.wire import (
    CANCEL_MEMORY_S,
    CANCEL_WAIT_S,
    DISCARD_CHUNK,
    FRAME,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    POLL_S,
    VERSION,
    check_hello,
    host_port,
    prove_hello,
    recv_bytes,
    recv_exact,
    recv_parts,
    send_parts,
    tensor_bytes,
    tune,
)
from kvwire.transfer.types import PeerRef, RecvItem, SendItem

__all__ = ["TcpPlane", "tensor_bytes"]

log = logging.getLogger(__name__)


class _Outbound(OutboundLink):
    """Writer thread for one peer epoch: connects, authenticates, writes queued layers in order."""

    kind = "tcp"

    def __init__(self, plane: TcpPlane, peer: PeerRef) -> None:
        self.plane = plane
        super().__init__(peer)

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(host_port(self.peer.data_address), timeout=HANDSHAKE_TIMEOUT_S)
        self.sock = sock
        tune(sock, self.plane.config.socket_buffer_bytes)
        prove_hello(sock, self.plane.secret, self.plane.instance_id, MAGIC, VERSION)
        sock.settimeout(None)
        return sock

    def _run(self) -> None:
        cb = self.plane.callbacks
        try:
            sock = self._connect()
            while not self.stopped.is_set():
                try:
                    item = self.queue.get(timeout=POLL_S)
                except queue.Empty:
                    self._check_alive(sock)
                    continue
                if item is None:
                    break
                if self.plane.is_cancelled(item.transfer_id):
                    continue
                self._write(sock, item)
                cb.on_sent(self.peer.instance_id, item.transfer_id, (item.layer_index,))
        except (OSError, ConnectionError) as exc:
            if not self.stopped.is_set():
                cb.on_peer_failed(
                    self.peer.instance_id, f"peer_lost: data connection to {self.peer.data_address}: {exc}"
                )
        finally:
            self._finish()

    def _check_alive(self, sock: socket.socket) -> None:
        # The receiver never writes on this connection: readable means EOF or reset (peer gone).
        readable, _, _ = select.select([sock], [], [], 0)
        if readable and not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
            raise ConnectionError("receiver closed the data connection")

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
        with self.plane._lock:
            self.dead = True
            if self.plane._outbound.get(self.peer.instance_id) is self:
                del self.plane._outbound[self.peer.instance_id]
        if self.sock is not None:
            self.sock.close()
        if not self.stopped.is_set():
            fail_queued(self.queue, self.plane.callbacks, "peer_lost: data connection closed")


class TcpPlane(DataPlane):
    """Raw-socket data plane for CPU tensors (CUDA tensors are staged through host memory)."""

    ordered = False
    supports_spans = True
    early_grants = True  # a data frame must match its posted item's size

    def __init__(self, config: TransferConfig, instance_id: str) -> None:
        self.config = config
        self.instance_id = instance_id
        self.secret = config.secret
        self._lock = threading.Lock()
        self._outbound: dict[str, _Outbound] = {}
        self._inbound: dict[socket.socket, str] = {}  # connection -> peer instance id ("" = handshaking)
        self._readers: set[threading.Thread] = set()
        self._posted: dict[tuple[str, int], tuple[str, RecvItem]] = {}
        self._cancelled: dict[str, float] = {}
        self._writing: dict[socket.socket, str] = {}  # connection -> transfer being written into spans
        self._written = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._listener: socket.socket | None = None
        self._address = ""  # what peers dial (config.advertise_*); bound_address: where we listen
        self.bound_address = ""
        self._acceptor: threading.Thread | None = None
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
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvwire-tcp-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        assert self._address, "start() first"
        return self._address

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        with self._lock:
            outbound = list(self._outbound.values())
            inbound = list(self._inbound)
            self._posted.clear()
        for out in outbound:
            out.stop()
        for sock in inbound:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join(timeout=5.0)
        for out in outbound:
            out.thread.join(timeout=5.0)
        with self._lock:
            readers = list(self._readers)
        for reader in readers:
            reader.join(timeout=5.0)
        if self._listener is not None:
            self._listener.close()

    # --- sender side ---------------------------------------------------------------------------------

    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        with self._lock:
            if self._closing.is_set():
                return
            out = self._outbound.get(peer.instance_id)
            if out is None or out.dead:
                out = _Outbound(self, peer)
                self._outbound[peer.instance_id] = out
                out.thread.start()
        for item in items:
            out.queue.put(item)

    def is_cancelled(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._cancelled

    def cancel(self, transfer_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._cancelled[transfer_id] = now
            if len(self._cancelled) > 4096:
                self._cancelled = {t: s for t, s in self._cancelled.items() if now - s < CANCEL_MEMORY_S}
            for key in [k for k in self._posted if k[0] == transfer_id]:
                del self._posted[key]
            # A frame being written into the caller's memory (spans) must end before cancel returns:
            # the caller may reuse those blocks once the transfer failed. Bounded: then cut the link.
            finished = self._written.wait_for(
                lambda: transfer_id not in self._writing.values(), CANCEL_WAIT_S
            )
            conns = [] if finished else [c for c, t in self._writing.items() if t == transfer_id]
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def drop_peer(self, peer_instance_id: str) -> None:
        with self._lock:
            out = self._outbound.pop(peer_instance_id, None)
            inbound = [s for s, pid in self._inbound.items() if pid == peer_instance_id]
            for key in [k for k, (pid, _) in self._posted.items() if pid == peer_instance_id]:
                del self._posted[key]
        if out is not None:
            out.stop()
        for sock in inbound:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # --- receiver side -------------------------------------------------------------------------------

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        with self._lock:
            for item in items:
                self._posted[(item.transfer_id, item.layer_index)] = (peer.instance_id, item)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closing.is_set():
                    return
                continue
            reader = threading.Thread(target=self._serve, args=(conn,), name="kvwire-tcp-recv", daemon=True)
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                    return
                self._inbound[conn] = ""
                self._readers.add(reader)
            reader.start()

    def _handshake(self, conn: socket.socket) -> str:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        tune(conn, self.config.socket_buffer_bytes)
        peer_id = check_hello(conn, self.secret, MAGIC, VERSION, "data connection")
        conn.settimeout(None)
        return peer_id

    def _serve(self, conn: socket.socket) -> None:
        peer_id = ""
        # Arrivals are reported from a second thread, so that the caller's sink (a scatter) for
        # layer i overlaps the socket read of layer i+1. FIFO; bounded by the credit granted.
        arrivals: queue.SimpleQueue[tuple[str, str, int] | None] = queue.SimpleQueue()
        reporter = threading.Thread(
            target=self._report_arrivals, args=(arrivals,), name="kvwire-tcp-deliver", daemon=True
        )
        error: BaseException | None = None
        try:
            peer_id = self._handshake(conn)
            with self._lock:
                self._inbound[conn] = peer_id
            reporter.start()
            while not self._closing.is_set():
                arrived = self._read_frame(conn, peer_id)
                if arrived is not None:
                    arrivals.put((peer_id, *arrived))
        except (ProtocolError, OSError, ConnectionError) as exc:
            error = exc
        finally:
            if reporter.is_alive():  # report what fully arrived before any failure
                arrivals.put(None)
                reporter.join(timeout=10.0)
            with self._lock:
                self._inbound.pop(conn, None)
            conn.close()
        try:
            if isinstance(error, ProtocolError):
                self.callbacks.on_protocol_error(f"data connection refused: {error}")
            elif error is not None and not peer_id:
                self.callbacks.on_protocol_error(f"data connection failed during handshake: {error}")
            elif error is not None and not self._closing.is_set():
                self.callbacks.on_peer_failed(peer_id, f"peer_lost: data connection from peer broke: {error}")
        finally:
            with self._lock:
                self._readers.discard(threading.current_thread())  # last: close() joins until here

    def _report_arrivals(self, arrivals: queue.SimpleQueue[tuple[str, str, int] | None]) -> None:
        while (arrival := arrivals.get()) is not None:
            peer_id, transfer_id, layer_index = arrival
            self.callbacks.on_received(peer_id, transfer_id, (layer_index,))

    def _read_frame(self, conn: socket.socket, peer_id: str) -> tuple[str, int] | None:
        """Read one frame into its posted buffer; (transfer id, layer) when one landed."""
        layer, num_bytes, tid_len = FRAME.unpack(recv_bytes(conn, FRAME.size))
        tid = recv_bytes(conn, tid_len).decode(errors="replace")
        with self._lock:
            posted = self._posted.pop((tid, layer), None)
            valid = posted is not None and posted[0] == peer_id and posted[1].num_bytes == num_bytes
            if valid and posted is not None and posted[1].dest_spans is not None:
                self._writing[conn] = tid  # in the same critical section: cancel() sees it
        if not valid or posted is None:
            if posted is not None:
                self.callbacks.on_transfer_failed(
                    tid, f"mismatch: layer {layer} frame of {num_bytes} bytes from an unexpected sender/size"
                )
            elif not self.is_cancelled(tid):
                self.callbacks.on_protocol_error(
                    f"unsolicited frame for {tid!r} layer {layer} ({num_bytes} B)"
                )
            self._discard(conn, num_bytes)
            return None
        item = posted[1]
        if item.dest_spans is not None:  # straight into the caller's blocks: the kernel scatters
            base = tensor_bytes(item.dest_spans.base)
            try:
                recv_parts(conn, [base[off : off + n] for off, n in item.dest_spans.spans])
            finally:
                with self._lock:
                    self._writing.pop(conn, None)
                    self._written.notify_all()
        elif item.dest.device.type == "cpu":
            recv_exact(conn, tensor_bytes(item.dest)[:num_bytes])
        else:  # stage through host memory
            staging = torch.empty(num_bytes, dtype=torch.uint8)
            recv_exact(conn, tensor_bytes(staging))
            item.dest[:num_bytes].copy_(staging)
        return tid, layer

    @staticmethod
    def _discard(conn: socket.socket, num_bytes: int) -> None:
        scratch = memoryview(bytearray(min(num_bytes, DISCARD_CHUNK) or 1))
        left = num_bytes
        while left > 0:
            n = min(left, len(scratch))
            recv_exact(conn, scratch[:n])
            left -= n
