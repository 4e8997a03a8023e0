"""Receiver half of the shared-memory plane: one reader thread per inbound peer connection.

The reader authenticates the sender, creates this connection's ring (a memfd of
``config.shm_ring_bytes``) and passes it over with the sender's own grant table (its region) and
the shared regions it exports (SCM_RIGHTS), then handles frames in order: a CHUNK is copied out of
the ring into the posted destination (the caller's byte spans, or the receive buffer) and
credited; a DONE says the sender wrote the whole layer straight into the destination (the one-copy
path). Once a layer's bytes are all in place it is reported (from a second thread, so the caller's
sink for layer i overlaps the copy of layer i+1, as on the TCP plane).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import socket
import threading
from typing import TYPE_CHECKING

from kvwire.errors import ProtocolError
from kvwire.supervision import SupervisedThread
from kvwire.transfer.memory import RecvItem
from kvwire.transfer.planes.base import posted_for_another
from kvwire.transfer.planes.common.hello import check_hello
from kvwire.transfer.planes.common.liveness import count_cut
from kvwire.transfer.planes.common.wire import peer_uid, shutdown
from kvwire.transfer.planes.shm.ring import Bytes, SpanCursor, create_ring, ring_array, tensor_array
from kvwire.transfer.planes.shm.wire import CREDIT, FRAME, MAGIC, VERSION, Frame, send_setup

if TYPE_CHECKING:
    from kvwire.transfer.planes.shm.plane import ShmPlane

_READ_BYTES = 64 << 10
_MAX_RING_POS = (1 << (8 * CREDIT.size)) - 1  # ring positions count bytes for ever: u64
Arrival = tuple[str, str, int] | None  # (peer id, transfer id, layer) or the end marker


@dataclasses.dataclass
class Landing:
    """A layer being received: where its bytes go and how far they got."""

    peer_id: str
    item: RecvItem
    cursor: SpanCursor


def landing_for(peer_id: str, item: RecvItem) -> Landing:
    if item.dest_spans is not None:
        return Landing(peer_id, item, SpanCursor(tensor_array(item.dest_spans.base), item.dest_spans.spans))
    if item.dest.device.type != "cpu":
        raise ProtocolError("the shared-memory plane receives into CPU memory only")
    return Landing(peer_id, item, SpanCursor(tensor_array(item.dest), [(0, item.num_bytes)]))


class Inbound:
    """Serves one accepted connection (runs on its own thread: :meth:`serve`)."""

    def __init__(self, plane: ShmPlane, conn: socket.socket) -> None:
        self.plane = plane
        self.conn = conn
        self.peer_id = ""
        self._region: str | None = None  # the peer whose grant region this link holds
        self._later: list[tuple[str, str]] = []  # (transfer id | "", reason): reported outside the lock
        self._inbox = bytearray()  # frame bytes read but not yet handled

    def _handshake(self) -> Bytes:
        conn, links = self.conn, self.plane.config.links
        conn.settimeout(self.plane.admission.hello_timeout_s())
        claim = check_hello(conn, self.plane.secret, MAGIC, VERSION, "shared-memory connection")
        peer_id = self.plane.admission.bind(claim, self.plane.instance_id, self.plane.callbacks, "shm link")
        size = self.plane.config.shm_ring_bytes
        fd, ring = create_ring(size)
        try:
            table = self.plane.grant_region_for_link(peer_id)  # its own: no other peer's grants
            self._region = peer_id  # held for this link until it ends (serve)
            # shared regions (our KV cache, readable and writable by whoever maps it) only to a
            # process of our own user, who could read our memory anyway; others get the ring
            regions = self.plane.exported_regions() if peer_uid(conn) == os.getuid() else []
            send_setup(conn, (fd, size), (table.fd, table.size), regions)
        finally:
            os.close(fd)  # the mapping (here) and the sender's keep the memory; no name exists
        self.plane.admission.authenticated(conn)
        conn.settimeout(links.link_timeout_s)  # credit writes' deadline; a read timeout is only idleness
        self.peer_id = peer_id
        return ring_array(ring)

    def serve(self) -> None:
        plane = self.plane
        arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        done = threading.Event()
        reporter = SupervisedThread(
            "kvwire-shm-deliver",
            functools.partial(self._report, arrivals, done),
            done,
            board=plane.board,
            on_dead=lambda _: shutdown(self.conn),  # nothing reports this link's layers: end it
        )
        error: BaseException | None = None
        try:
            ring = self._handshake()
            with plane.lock:
                plane.inbound[self.conn] = self.peer_id
            reporter.start()
            while not plane.closing.is_set():
                arrived = self._read_chunk(ring)
                if arrived is not None:
                    arrivals.put((self.peer_id, *arrived))
        except (ProtocolError, OSError, ConnectionError, ValueError) as exc:
            error = exc
        finally:
            if reporter.ident is not None:  # started: report what fully arrived before any failure
                done.set()
                arrivals.put(None)
                reporter.stop(10.0)  # also takes it off the board (dead or not)
            with plane.lock:
                plane.inbound.pop(self.conn, None)
                for key in [k for k, v in plane.landing.items() if v.peer_id == self.peer_id]:
                    del plane.landing[key]
            self.conn.close()
            plane.admission.release(self.conn)
            if self._region is not None:
                plane.link_closed(self._region)  # its region is freed unless grants remain in it
        try:
            self._report_end(error)
        finally:
            del error  # its traceback holds this frame (and the ring): no cycle keeps the mapping

    def _report_end(self, error: BaseException | None) -> None:
        plane = self.plane
        try:
            if isinstance(error, ProtocolError):
                plane.callbacks.on_protocol_error(f"shared-memory connection refused: {error}")
            elif error is not None and not self.peer_id:
                plane.callbacks.on_protocol_error(
                    f"shared-memory connection failed during handshake: {error}"
                )
            elif error is not None and not plane.closing.is_set():
                count_cut(plane.board, error)
                plane.callbacks.on_peer_failed(
                    self.peer_id, f"peer_lost: shared-memory link from peer broke: {error}"
                )
        finally:
            with plane.lock:
                plane.readers.discard(threading.current_thread())  # last: close() joins until here

    def _report(self, arrivals: queue.SimpleQueue[Arrival], done: threading.Event) -> None:
        """Reporter body (supervised: restarted if the callback raises). Report arrived layers; layers
        of one transfer that arrived together (a sender's batch of DONE frames) go in one call, so the
        agent wakes its control thread and acks once for them. Returns at the end marker."""
        end = False
        while not end and (arrival := arrivals.get()) is not None:
            batch = [arrival]
            while True:
                try:
                    more = arrivals.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    end = True
                    break
                batch.append(more)
            for (peer_id, transfer_id), layers in _grouped(batch):
                self.plane.callbacks.on_received(peer_id, transfer_id, layers)
        done.set()  # the end marker came: the link ended (not a failure of this body)

    def _take(self, num_bytes: int) -> bytes:
        """The next ``num_bytes`` of the frame stream; ConnectionError on EOF. Reads whatever the
        socket holds (a sender's batch of DONE frames arrives in one read), so frames that came
        together are handled without a system call each."""
        inbox = self._inbox
        while len(inbox) < num_bytes:
            try:
                more = self.conn.recv(max(_READ_BYTES, num_bytes - len(inbox)))
            except TimeoutError:  # an idle link (a dead peer shows as EOF)
                if self.plane.closing.is_set():
                    raise
                continue
            if not more:
                raise ConnectionError("connection closed by peer")
            inbox += more
        out = bytes(inbox[:num_bytes])
        del inbox[:num_bytes]
        return out

    def _read_chunk(self, ring: Bytes) -> tuple[str, int] | None:
        """Handle one chunk frame; (transfer id, layer) when it completed a layer."""
        conn, plane = self.conn, self.plane
        kind, layer, total, layer_off, pos, num_bytes, tid_len = FRAME.unpack(self._take(FRAME.size))
        tid = self._take(tid_len).decode(errors="replace")
        if kind == Frame.DONE:
            return self._written(tid, layer, total)
        if kind != Frame.CHUNK:
            raise ProtocolError(f"unknown shared-memory frame kind {kind}")
        if pos + num_bytes > _MAX_RING_POS:  # the credit it answers must fit its field
            raise ProtocolError(f"chunk at ring position {pos} of {num_bytes} bytes is out of range")
        at = pos % ring.size
        if at + num_bytes > ring.size:
            raise ProtocolError(f"chunk at ring position {pos} of {num_bytes} bytes runs past the ring")
        key = (tid, layer)
        with plane.lock:
            landing = plane.landing.get(key) if layer_off else self._start_layer(key, total)
            if landing is not None and (landing.cursor.pos != layer_off or landing.peer_id != self.peer_id):
                landing = None  # out of order, or another peer's layer (decision 126): dropped
            if landing is not None:
                plane.writing[conn] = tid  # in the same critical section: cancel() sees it
        if landing is None:  # only then are failures queued: none is reported while ``writing`` is set
            self._flush_later()
            conn.sendall(CREDIT.pack(pos + num_bytes))  # dropped (cancelled/unsolicited): free it
            return None
        try:
            landing.cursor.scatter(ring, at, num_bytes)
        finally:
            with plane.lock:
                plane.writing.pop(conn, None)
                plane.written.notify_all()
        conn.sendall(CREDIT.pack(pos + num_bytes))
        if landing.cursor.remaining():
            return None
        with plane.lock:
            done = plane.landing.pop(key, None) is landing
            if done:
                plane.landed_locked(tid, layer)
        return (tid, layer) if done else None

    def _written(self, tid: str, layer: int, total: int) -> tuple[str, int] | None:
        """A DONE frame: the sender wrote the layer into its granted shared destination."""
        plane, key = self.plane, (tid, layer)
        with plane.lock:
            foreign = posted_for_another(plane.posted, key, self.peer_id)
            posted = None if foreign else plane.posted.pop(key, None)
            done = posted is not None and posted[0] == self.peer_id and posted[1].num_bytes == total
            if done:
                plane.landed_locked(tid, layer)
            elif foreign:  # another peer's transfer: left posted (decision 126)
                self._not_its_sender(tid, layer)
            elif posted is not None:
                reason = f"mismatch: layer {layer} of {total} bytes, not the size posted"
                self._later.append((tid, reason))
            elif tid not in plane.cancelled:
                self._later.append(("", f"unsolicited shared-memory layer {tid!r} {layer} ({total} B)"))
        self._flush_later()
        return key if done else None

    def _start_layer(self, key: tuple[str, int], total: int) -> Landing | None:
        """First chunk of a layer (caller holds the lock): match it to its posted receive."""
        plane = self.plane
        foreign = posted_for_another(plane.posted, key, self.peer_id)
        posted = None if foreign else plane.posted.pop(key, None)
        if posted is None or posted[0] != self.peer_id or posted[1].num_bytes != total:
            if foreign:  # another peer's transfer: left posted (decision 126)
                self._not_its_sender(*key)
            elif posted is not None:
                self._later.append(
                    (key[0], f"mismatch: layer {key[1]} of {total} bytes, not the size posted")
                )
            elif key[0] not in plane.cancelled:
                self._later.append(
                    ("", f"unsolicited shared-memory chunk for {key[0]!r} layer {key[1]} ({total} B)")
                )
            return None
        try:
            landing = landing_for(self.peer_id, posted[1])
        except ProtocolError as exc:
            self._later.append((key[0], f"mismatch: {exc}"))
            return None
        plane.landing[key] = landing
        return landing

    def _not_its_sender(self, tid: str, layer: int) -> None:
        self._later.append(("", f"shared-memory layer {tid!r} {layer} from {self.peer_id!r}, not its sender"))

    def _flush_later(self) -> None:
        later, self._later = self._later, []
        for transfer_id, reason in later:
            if transfer_id:
                self.plane.callbacks.on_transfer_failed(transfer_id, reason)
            else:
                self.plane.callbacks.on_protocol_error(reason)


def _grouped(arrivals: list[tuple[str, str, int]]) -> list[tuple[tuple[str, str], tuple[int, ...]]]:
    """Consecutive arrivals of one (peer, transfer) merged: [((peer, transfer), layers)], in order."""
    out: list[tuple[tuple[str, str], list[int]]] = []
    for peer_id, transfer_id, layer in arrivals:
        if out and out[-1][0] == (peer_id, transfer_id):
            out[-1][1].append(layer)
        else:
            out.append(((peer_id, transfer_id), [layer]))
    return [(key, tuple(layers)) for key, layers in out]
