"""Sender half of the shared-memory plane: one writer thread per peer epoch.

The writer connects to the receiver's abstract Unix socket, authenticates (the TCP plane's hello),
receives and maps the receiver's ring, grant table and exported shared regions, then per queued
layer:

* one-copy path: the receiver granted a destination in one of those regions, so the writer copies
  the layer's block runs straight into it (holding the grant's slot lock, which the receiver's
  cancel takes to revoke: ``grants``) and sends one DONE frame;
* ring path (any other destination): copies the byte runs into the ring chunk by chunk and
  announces each chunk with a small frame. The receiver returns credit (the ring position it has
  consumed) after copying each chunk out, so the ring bounds the bytes in flight and the two copies
  (this gather, the receiver's scatter) overlap chunk by chunk.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import select
import socket
from typing import TYPE_CHECKING

from kvwire.transfer.planes.base import fail_queued
from kvwire.transfer.planes.ipc.runs import Run
from kvwire.transfer.planes.outbound import OutboundLink
from kvwire.transfer.planes.shm.direct import MappedRegions, ShmDest, check_runs, layer_runs
from kvwire.transfer.planes.shm.grants import GrantView
from kvwire.transfer.planes.shm.ring import Bytes, SpanCursor, map_ring, next_slot, ring_array, tensor_array
from kvwire.transfer.planes.shm.wire import (
    CHUNK_BYTES,
    CREDIT,
    FRAME,
    MAGIC,
    VERSION,
    Frame,
    recv_setup,
)
from kvwire.transfer.planes.tcp.wire import (
    CANCEL_WAIT_S,
    POLL_S,
    prove_hello,
)
from kvwire.transfer.types import PeerRef, SendItem

if TYPE_CHECKING:
    from kvwire.transfer.planes.shm.plane import ShmPlane


class _Cancelled(Exception):
    """The item's transfer was cancelled between two chunks."""


class Outbound(OutboundLink):
    """Writer thread for one peer epoch."""

    kind = "shm"

    def __init__(self, plane: ShmPlane, peer: PeerRef) -> None:
        self.plane = plane
        super().__init__(peer)
        self._ring: mmap.mmap | None = None
        self._grants: GrantView | None = None
        self._regions = MappedRegions()
        self._last_runs: tuple[tuple[object, ...], list[Run]] | None = None
        self._head = 0  # ring position of the next chunk (monotonic)
        self._consumed = 0  # ring position the receiver has copied out up to
        self._credit_buf = b""

    def _connect(self) -> socket.socket:
        sock = self._dial_unix()
        prove_hello(sock, self.plane.secret, self.plane.instance_id, MAGIC, VERSION)
        (ring_fd, ring_bytes), (table_fd, table_bytes), regions = recv_setup(sock)
        try:
            self._ring = map_ring(ring_fd, ring_bytes)
            self._grants = GrantView(table_fd, table_bytes)
            for region_id in list(regions):
                fd, size = regions.pop(region_id)
                self._regions.add(region_id, fd, size)
        finally:  # descriptors not consumed above (an error part way)
            for fd, _ in regions.values():
                os.close(fd)
        sock.settimeout(None)
        return sock

    def _run(self) -> None:
        cb = self.plane.callbacks
        try:
            self._pump(self._connect())
        except (OSError, ConnectionError, ValueError) as exc:
            if not self.stopped.is_set():
                cb.on_peer_failed(
                    self.peer.instance_id, f"peer_lost: shared-memory link to {self.peer.endpoint}: {exc}"
                )
        finally:
            self._finish()

    def _pump(self, sock: socket.socket) -> None:
        """Write queued layers until stopped (the ring's array lives in this frame only, so that
        ``_finish`` can unmap the ring)."""
        cb = self.plane.callbacks
        assert self._ring is not None
        ring = ring_array(self._ring)
        while not self.stopped.is_set():
            try:
                item = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                self._read_credit(sock, wait=False)  # also notices a receiver that went away
                continue
            if item is None:
                break
            if self.plane.is_cancelled(item.transfer_id):
                continue
            dest = self.plane.take_dest(self.peer.instance_id, item.transfer_id, item.layer_index)
            try:
                if dest is not None and dest.region in self._regions.arrays:
                    if not self._write_direct(sock, item, dest):
                        continue
                else:
                    self._write(sock, ring, item)
            except _Cancelled:
                continue
            cb.on_sent(self.peer.instance_id, item.transfer_id, (item.layer_index,))

    def _write_direct(self, sock: socket.socket, item: SendItem, dest: ShmDest) -> bool:
        """Copy the layer straight into the receiver's granted blocks, then DONE. False when the
        layer failed (reported) and must not count as sent."""
        if item.spans is not None:
            src, src_spans = tensor_array(item.spans.base), list(item.spans.spans)
        else:
            tensor = item.tensor if item.tensor.device.type == "cpu" else item.tensor.cpu()
            src = tensor_array(tensor)
            src_spans = [(0, src.size)]
        region = self._regions.arrays[dest.region]
        try:
            runs = self._runs(src_spans, dest.spans, src.size, region.size)
        except ValueError as exc:
            self.plane.callbacks.on_transfer_failed(
                item.transfer_id, f"mismatch: shared-memory layer {item.layer_index}: {exc}"
            )
            return False
        assert self._grants is not None
        try:
            with self._grants.holding(dest.slot, dest.token, CANCEL_WAIT_S * 5) as granted:
                if not granted or self.plane.is_cancelled(item.transfer_id):
                    raise _Cancelled  # the receiver revoked the grant: its blocks may be in use again
                self.plane.copier.copy(src, region, runs)
        except TimeoutError as exc:
            raise ConnectionError(f"receiver kept its grant table locked: {exc}") from exc
        tid = item.transfer_id.encode()
        total = sum(n for _, _, n in runs)
        self._count("one_copy")  # before the frame: once the receiver has it, the layer may complete
        sock.sendall(FRAME.pack(Frame.DONE, item.layer_index, total, 0, 0, total, len(tid)) + tid)
        return True

    def _write(self, sock: socket.socket, ring: Bytes, item: SendItem) -> None:
        if item.spans is not None:
            cursor = SpanCursor(tensor_array(item.spans.base), item.spans.spans)
        else:
            tensor = item.tensor if item.tensor.device.type == "cpu" else item.tensor.cpu()
            flat = tensor_array(tensor)
            cursor = SpanCursor(flat, [(0, flat.size)])
        tid = item.transfer_id.encode()
        size = ring.size
        chunk_max = min(CHUNK_BYTES, size // 4)
        total = cursor.total
        while True:
            n = min(chunk_max, cursor.remaining())
            pos = self._reserve(sock, n, size)
            if self.plane.is_cancelled(item.transfer_id):
                raise _Cancelled
            layer_off = cursor.pos
            cursor.gather(ring, pos % size, n)
            if cursor.remaining() == 0:
                self._count("ring")
            sock.sendall(FRAME.pack(Frame.CHUNK, item.layer_index, total, layer_off, pos, n, len(tid)) + tid)
            self._head = pos + n
            if cursor.remaining() == 0:
                return

    def _runs(
        self, src: list[tuple[int, int]], dst: list[tuple[int, int]], src_size: int, dst_size: int
    ) -> list[Run]:
        """The checked runs of a layer; the layers of one transfer share their spans (same blocks,
        same layer geometry), so the last result is reused when the spans and sizes repeat."""
        key = (src, dst, src_size, dst_size)
        if self._last_runs is not None and self._last_runs[0] == key:
            return self._last_runs[1]
        runs = layer_runs(src, dst)
        check_runs(runs, src_size, dst_size)
        self._last_runs = (key, runs)
        return runs

    def _count(self, path: str) -> None:
        with self.plane.lock:
            self.plane.layers_sent[path] += 1

    def _reserve(self, sock: socket.socket, num_bytes: int, size: int) -> int:
        """Ring position for the next chunk, once the receiver has freed enough (waits for credit).
        Credits are drained before every chunk, not only when the ring is full: many small layers
        would otherwise fill the socket with unread credits until the receiver blocks writing one
        while this side blocks writing a frame."""
        self._read_credit(sock, wait=False)
        pos = next_slot(self._head, num_bytes, size)
        while pos + num_bytes - self._consumed > size:
            if self.stopped.is_set():
                raise ConnectionError("plane closing")
            self._read_credit(sock, wait=True)
        return pos

    def _read_credit(self, sock: socket.socket, wait: bool) -> None:
        readable, _, _ = select.select([sock], [], [], POLL_S if wait else 0)
        if not readable:
            return
        data = sock.recv(4096)
        if not data:
            raise ConnectionError("receiver closed the shared-memory link")
        buf = self._credit_buf + data
        whole = len(buf) - len(buf) % CREDIT.size
        if whole:
            self._consumed = max(self._consumed, CREDIT.unpack_from(buf, whole - CREDIT.size)[0])
        self._credit_buf = buf[whole:]

    def _finish(self) -> None:
        with self.plane.lock:
            self.dead = True
            if self.plane.outbound.get(self.peer.instance_id) is self:
                del self.plane.outbound[self.peer.instance_id]
        if self.sock is not None:
            self.sock.close()
        if self._ring is not None:
            with contextlib.suppress(BufferError):  # a numpy view may still be alive: GC unmaps then
                self._ring.close()
        self._regions.close()  # the receiver's KV cache: unmapped with the peer epoch
        if self._grants is not None:
            self._grants.close()
        if not self.stopped.is_set():
            fail_queued(self.queue, self.plane.callbacks, "peer_lost: shared-memory link closed")
