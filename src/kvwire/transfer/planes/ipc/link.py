"""The IPC plane's threads: a writer per peer (copies into the peer's mapped memory, then DONE) and
a reader per inbound link (DONE -> on_received). See :mod:`kvwire.transfer.planes.ipc.plane`."""

from __future__ import annotations

import contextlib
import hmac
import os
import queue
import select
import socket
import struct
import threading
from typing import TYPE_CHECKING

import torch

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.transfer.planes.ipc.copy import copy_runs
from kvwire.transfer.planes.ipc.runs import pair_runs
from kvwire.transfer.planes.shm.wire import abstract_name
from kvwire.transfer.planes.tcp.wire import (
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    MAC_BYTES,
    NONCE_BYTES,
    POLL_S,
    hello_mac,
    recv_bytes,
)
from kvwire.transfer.types import PeerRef, SendItem

if TYPE_CHECKING:
    from kvwire.transfer.planes.ipc.plane import IpcPlane

MAGIC = b"KVWI"
VERSION = 1
DONE = struct.Struct("!IH")  # layer, transfer-id length (the id follows)
MAX_BATCH = 64  # layers copied before one synchronization


class IpcOutbound:
    """Writer thread for one peer epoch."""

    def __init__(self, plane: IpcPlane, peer: PeerRef) -> None:
        self.plane = plane
        self.peer = peer
        self.queue: queue.SimpleQueue[SendItem | None] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.dead = False
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"kvwire-ipc-send-{peer.instance_id[:8]}", daemon=True
        )

    def stop(self) -> None:
        self.stopped.set()
        self.queue.put(None)
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = sock
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        sock.connect(abstract_name(self.peer.data_address))
        nonce = recv_bytes(sock, NONCE_BYTES)
        me = self.plane.instance_id.encode()
        sock.sendall(HELLO.pack(MAGIC, VERSION, len(me)) + me + hello_mac(self.plane.secret, nonce, me))
        sock.settimeout(None)
        return sock

    def _run(self) -> None:
        cb = self.plane.callbacks
        try:
            torch.cuda.set_device(self.plane.device)
            stream = torch.cuda.Stream(self.plane.device)
            sock = self._connect()
            while not self.stopped.is_set():
                batch = self._next_batch(sock)
                if batch is None:
                    break
                if batch:
                    self._copy(sock, stream, batch)
        except (OSError, ConnectionError) as exc:
            if not self.stopped.is_set():
                cb.on_peer_failed(
                    self.peer.instance_id, f"peer_lost: IPC link to {self.peer.endpoint}: {exc}"
                )
        finally:
            self._finish()

    def _next_batch(self, sock: socket.socket) -> list[SendItem] | None:
        """Up to MAX_BATCH queued items ([] after an idle poll; None: stop)."""
        try:
            first = self.queue.get(timeout=POLL_S)
        except queue.Empty:
            readable, _, _ = select.select([sock], [], [], 0)  # the receiver never writes: EOF
            if readable and not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                raise ConnectionError("receiver closed the IPC link") from None
            return []
        if first is None:
            return None
        batch = [first]
        while len(batch) < MAX_BATCH:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.stopped.set()
                break
            batch.append(item)
        return [i for i in batch if not self.plane.is_cancelled(i.transfer_id)]

    def _copy(self, sock: socket.socket, stream: torch.cuda.Stream, batch: list[SendItem]) -> None:
        cb = self.plane.callbacks
        copied: list[SendItem] = []
        with torch.cuda.stream(stream):
            for item in batch:
                error = self._enqueue(stream, item)
                if error:
                    cb.on_transfer_failed(item.transfer_id, error)
                else:
                    copied.append(item)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # every copy of the batch landed in the receiver's memory
        for item in copied:
            tid = item.transfer_id.encode()
            sock.sendall(DONE.pack(item.layer_index, len(tid)) + tid)
            cb.on_sent(self.peer.instance_id, item.transfer_id, (item.layer_index,))

    def _enqueue(self, stream: torch.cuda.Stream, item: SendItem) -> str:
        """Enqueue one layer's copies on ``stream``; an error text when it cannot be copied."""
        from kvwire.transfer.planes.ipc.cuda_ipc import wrap

        dest = self.plane.take_dest(self.peer.instance_id, item.transfer_id, item.layer_index)
        if dest is None:
            return f"mismatch: no IPC destination granted for layer {item.layer_index}"
        if not dest.handle:
            return (
                "mismatch: the receiver's buffer for this layer is not device memory (IPC needs GPU memory)"
            )
        if item.spans is not None:
            src = item.spans.flat()
            src_spans = list(item.spans.spans)
        else:
            src = item.tensor.reshape(-1).view(torch.uint8)
            src_spans = [(0, src.numel())]
        if src.device.type != "cuda":
            return "mismatch: the IPC plane sends device memory only"
        try:
            runs = pair_runs(src_spans, [tuple(s) for s in dest.spans])  # type: ignore[misc]
            address = self.plane.imports.address(self.peer.instance_id, dest.handle)
        except Exception as exc:
            return f"mismatch: IPC layer {item.layer_index}: {exc}"
        extent = max((off + n for off, n in dest.spans), default=0)
        dst = wrap(address, extent, self.plane.device)
        if item.ready_event is not None:
            stream.wait_event(item.ready_event)
        copy_runs(src, dst, runs)
        return ""

    def _finish(self) -> None:
        plane = self.plane
        with plane.lock:
            self.dead = True
            if plane.outbound.get(self.peer.instance_id) is self:
                del plane.outbound[self.peer.instance_id]
            with contextlib.suppress(Exception):
                plane.imports.close_peer(self.peer.instance_id)
        if self.sock is not None:
            self.sock.close()
        failed: set[str] = set()
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and item.transfer_id not in failed and not self.stopped.is_set():
                failed.add(item.transfer_id)
                plane.callbacks.on_transfer_failed(item.transfer_id, "peer_lost: IPC link closed")


class IpcInbound:
    """Reader of one accepted link: authenticates, then turns DONE frames into on_received."""

    def __init__(self, plane: IpcPlane, conn: socket.socket) -> None:
        self.plane = plane
        self.conn = conn
        self.peer_id = ""

    def _handshake(self) -> None:
        conn = self.conn
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = os.urandom(NONCE_BYTES)
        conn.sendall(nonce)
        magic, version, id_len = HELLO.unpack(recv_bytes(conn, HELLO.size))
        if magic != MAGIC or version != VERSION or not 0 < id_len <= 512:
            raise ProtocolError(f"bad IPC hello (magic {magic!r}, version {version})")
        peer_id = recv_bytes(conn, id_len)
        if not hmac.compare_digest(recv_bytes(conn, MAC_BYTES), hello_mac(self.plane.secret, nonce, peer_id)):
            raise AuthenticationError("IPC link could not prove the shared secret")
        conn.settimeout(None)
        self.peer_id = peer_id.decode(errors="replace")

    def serve(self) -> None:
        plane = self.plane
        error: BaseException | None = None
        try:
            self._handshake()
            with plane.lock:
                plane.inbound[self.conn] = self.peer_id
            while not plane.closing.is_set():
                layer, tid_len = DONE.unpack(recv_bytes(self.conn, DONE.size))
                tid = recv_bytes(self.conn, tid_len).decode(errors="replace")
                if plane.done(self.peer_id, tid, layer):
                    plane.callbacks.on_received(self.peer_id, tid, (layer,))
        except (ProtocolError, OSError, ConnectionError) as exc:
            error = exc
        finally:
            with plane.lock:
                plane.inbound.pop(self.conn, None)
            self.conn.close()
        try:
            if isinstance(error, ProtocolError):
                plane.callbacks.on_protocol_error(f"IPC link refused: {error}")
            elif error is not None and self.peer_id and not plane.closing.is_set():
                plane.callbacks.on_peer_failed(self.peer_id, f"peer_lost: IPC link from peer broke: {error}")
        finally:
            del error
            with plane.lock:
                plane.readers.discard(threading.current_thread())
