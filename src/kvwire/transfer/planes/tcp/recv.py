"""Receiver half of the TCP data plane: one reader thread per accepted connection (see
:mod:`kvwire.transfer.planes.tcp.plane`).

The reader checks the hello (the listener's admission cuts it at the handshake deadline), then reads
frames straight into their posted buffers. Arrivals are reported from a second, supervised thread,
so that the caller's sink (a scatter) for layer i overlaps the socket read of layer i+1. After the
hello the socket's timeout is ``keepalive_s``: a read that times out is an idle moment, where the
reader sends its heartbeat and cuts a link that heard nothing (no frame, no heartbeat) for
``link_timeout_s``; it also sends its heartbeat every ``keepalive_s`` while bytes flow (even in the
middle of one long frame), so the writer, which drains them only while idle, always finds a recent one.
"""

from __future__ import annotations

import functools
import queue
import socket
import threading
from typing import TYPE_CHECKING

import torch

from kvwire.errors import ProtocolError
from kvwire.supervision import SupervisedThread
from kvwire.transfer.planes.base import posted_for_another
from kvwire.transfer.planes.common.hello import check_hello
from kvwire.transfer.planes.common.liveness import Heartbeat, count_cut, tcp_keepalive
from kvwire.transfer.planes.common.wire import recv_bytes, recv_exact, recv_parts, shutdown
from kvwire.transfer.planes.tcp.wire import (
    DISCARD_CHUNK,
    FRAME,
    MAGIC,
    PING_LAYER,
    RECEIVER_PING,
    VERSION,
    tensor_bytes,
    tune,
)

if TYPE_CHECKING:
    from kvwire.transfer.planes.tcp.plane import TcpPlane

Arrival = tuple[str, str, int] | None  # (peer id, transfer id, layer) or the end marker
_REPORT_JOIN_S = 10.0


class TcpInbound:
    """Serves one accepted connection (on its own thread: :meth:`serve`)."""

    def __init__(self, plane: TcpPlane, conn: socket.socket) -> None:
        self.plane = plane
        self.conn = conn
        self.peer_id = ""

    def _handshake(self) -> None:
        conn, config = self.conn, self.plane.config
        conn.settimeout(self.plane.admission.hello_timeout_s())
        tune(conn, config.socket_buffer_bytes)
        tcp_keepalive(conn, config.links)
        plane = self.plane
        claim = check_hello(conn, plane.secret, MAGIC, VERSION, "data connection")
        self.peer_id = plane.admission.bind(claim, plane.instance_id, plane.callbacks, "data link")
        self.plane.admission.authenticated(conn)
        conn.settimeout(config.links.keepalive_s)  # reads wake to heartbeat; writes (pings) are tiny

    def serve(self) -> None:
        plane, conn = self.plane, self.conn
        arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        done = threading.Event()
        reporter = SupervisedThread(
            "kvwire-tcp-deliver",
            functools.partial(self._report, arrivals, done),
            done,
            board=plane.board,
            on_dead=lambda _: shutdown(conn),  # nothing reports this link's layers: end it (peer_lost)
        )
        error: BaseException | None = None
        try:
            self._handshake()
            with plane.lock:
                plane.inbound[conn] = self.peer_id
            reporter.start()
            beat = Heartbeat(conn, plane.config.links, RECEIVER_PING, "tcp data link")
            while not plane.closing.is_set():
                arrived = self._read_frame(beat)
                if arrived is not None:
                    arrivals.put((self.peer_id, *arrived))
        except (ProtocolError, OSError, ConnectionError) as exc:
            error = exc
        finally:
            if reporter.ident is not None:  # started: report what fully arrived before any failure
                done.set()
                arrivals.put(None)
                reporter.stop(_REPORT_JOIN_S)  # also takes it off the board (dead or not)
            with plane.lock:
                plane.inbound.pop(conn, None)
            conn.close()
            plane.admission.release(conn)
        try:
            self._report_end(error)
        finally:
            del error
            with plane.lock:
                plane.readers.discard(threading.current_thread())  # last: close() joins until here

    def _report_end(self, error: BaseException | None) -> None:
        cb = self.plane.callbacks
        if isinstance(error, ProtocolError):
            cb.on_protocol_error(f"data connection refused: {error}")
        elif error is not None and not self.peer_id:
            cb.on_protocol_error(f"data connection failed during handshake: {error}")
        elif error is not None and not self.plane.closing.is_set():
            count_cut(self.plane.board, error)
            cb.on_peer_failed(self.peer_id, f"peer_lost: data connection from peer broke: {error}")

    def _report(self, arrivals: queue.SimpleQueue[Arrival], done: threading.Event) -> None:
        """Reporter body (supervised: restarted if the callback raises): report until the end marker."""
        while (arrival := arrivals.get()) is not None:
            peer_id, transfer_id, layer_index = arrival
            self.plane.callbacks.on_received(peer_id, transfer_id, (layer_index,))
        done.set()  # the end marker: the body returns because the link ended, not as a failure

    def _read_frame(self, beat: Heartbeat) -> tuple[str, int] | None:
        """Read one frame into its posted buffer; (transfer id, layer) when one landed."""
        conn, plane = self.conn, self.plane
        layer, num_bytes, tid_len = FRAME.unpack(recv_bytes(conn, FRAME.size, beat))
        if layer == PING_LAYER:
            if num_bytes or tid_len:
                raise ProtocolError(f"heartbeat frame with {num_bytes} payload bytes and a {tid_len}-byte id")
            return None
        tid = recv_bytes(conn, tid_len, beat).decode(errors="replace")
        with plane.lock:
            foreign = posted_for_another(plane.posted, (tid, layer), self.peer_id)
            posted = None if foreign else plane.posted.pop((tid, layer), None)
            valid = posted is not None and posted[0] == self.peer_id and posted[1].num_bytes == num_bytes
            if valid and posted is not None and posted[1].dest_spans is not None:
                plane.writing[conn] = tid  # in the same critical section: cancel() sees it
        if not valid or posted is None:
            if posted is not None:
                reason = f"mismatch: layer {layer} frame of {num_bytes} bytes, not the size posted"
                plane.callbacks.on_transfer_failed(tid, reason)
            elif foreign:  # another peer's transfer: discarded, that peer's receive left posted
                plane.callbacks.on_protocol_error(
                    f"frame for {tid!r} layer {layer} from {self.peer_id!r}, which is not its sender"
                )
            elif not plane.is_cancelled(tid):
                reason = f"unsolicited frame for {tid!r} layer {layer} ({num_bytes} B)"
                plane.callbacks.on_protocol_error(reason)
            self._discard(num_bytes, beat)
            return None
        item = posted[1]
        if item.dest_spans is not None:  # straight into the caller's blocks: the kernel scatters
            base = tensor_bytes(item.dest_spans.base)
            try:
                recv_parts(conn, [base[off : off + n] for off, n in item.dest_spans.spans], beat)
            finally:
                with plane.lock:
                    plane.writing.pop(conn, None)
                    plane.written.notify_all()
        elif item.dest.device.type == "cpu":
            recv_exact(conn, tensor_bytes(item.dest)[:num_bytes], beat)
        else:  # stage through host memory
            staging = torch.empty(num_bytes, dtype=torch.uint8)
            recv_exact(conn, tensor_bytes(staging), beat)
            item.dest[:num_bytes].copy_(staging)
        return tid, layer

    def _discard(self, num_bytes: int, beat: Heartbeat) -> None:
        scratch = memoryview(bytearray(min(num_bytes, DISCARD_CHUNK) or 1))
        left = num_bytes
        while left > 0:
            n = min(left, len(scratch))
            recv_exact(self.conn, scratch[:n], beat)
            left -= n
