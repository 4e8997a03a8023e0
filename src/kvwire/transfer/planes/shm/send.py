"""Sender half of the shared-memory plane: one writer thread per peer epoch.

The writer connects to the receiver's abstract Unix socket, authenticates (the TCP plane's hello),
receives and maps the receiver's ring, grant table and exported shared regions, then per queued
layer:

* one-copy path: the receiver granted a destination in one of those regions, so the writer copies
  the layer's block runs straight into it (holding the grant's slot lock, which the receiver's
  cancel takes to revoke: ``grants``) and sends one DONE frame. Layers of one transfer queued
  together go as a batch: one lock hold for them (the grant re-checked before each layer), their
  DONE frames written together, at least every ``ANNOUNCE_S`` while the batch lasts;
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
import signal
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvwire.transfer.memory import PeerRef, SendItem
from kvwire.transfer.planes.base import fail_queued
from kvwire.transfer.planes.common.hello import prove_hello
from kvwire.transfer.planes.common.liveness import count_cut
from kvwire.transfer.planes.common.outbound import OutboundLink
from kvwire.transfer.planes.common.runs import Run
from kvwire.transfer.planes.common.wire import CANCEL_WAIT_S, POLL_S
from kvwire.transfer.planes.shm.direct import MappedRegions, RunPlans, ShmDest, SourceViews, halves
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

if TYPE_CHECKING:
    from kvwire.transfer.planes.shm.plane import ShmPlane


# while a batch lasts, its written layers are announced (DONE frames) at least this often: a batch
# holds everything queued, so the receiver learns of its first layers before the last is copied
ANNOUNCE_S = 0.01


def _payload_bytes(item: SendItem) -> int:
    if item.spans is not None:
        return item.spans.num_bytes
    return item.tensor.numel() * item.tensor.element_size()


class _Cancelled(Exception):
    """The item's transfer was cancelled between two chunks."""


class Outbound(OutboundLink):
    """Writer thread for one peer epoch."""

    kind = "shm"

    def __init__(self, plane: ShmPlane, peer: PeerRef) -> None:
        self.plane = plane
        super().__init__(peer, plane.board)
        self._ring: mmap.mmap | None = None
        self._grants: GrantView | None = None
        self._regions = MappedRegions()
        self._plans = RunPlans()  # the layers of one transfer share their copy plan
        self._sources = SourceViews()  # the sender's KV cache tensors, viewed once
        self._head = 0  # ring position of the next chunk (monotonic)
        self._consumed = 0  # ring position the receiver has copied out up to
        self._credit_buf = b""

    def _connect(self) -> socket.socket:
        links = self.plane.config.links
        sock = self._dial_unix(links.handshake_timeout_s)
        prove_hello(sock, self.plane.secret, self.plane.instance_id, self.peer.instance_id, MAGIC, VERSION)
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
        sock.settimeout(links.link_timeout_s)  # every write's deadline from here on
        return sock

    def _run(self) -> None:
        cb = self.plane.callbacks
        error: BaseException | None = None
        try:
            self._pump(self._connect())
        except (OSError, ConnectionError, ValueError) as exc:
            if not self.stopped.is_set():
                error = exc
                cb.on_peer_failed(
                    self.peer.instance_id, f"peer_lost: shared-memory link to {self.peer.endpoint}: {exc}"
                )
        finally:
            count_cut(self.board, error)
            del error
            self._finish()

    def _pump(self, sock: socket.socket) -> None:
        """Write queued layers until stopped (the ring's array lives in this frame only, so that
        ``_finish`` can unmap the ring). Layers queued together go as one batch: consecutive
        one-copy layers of a transfer are written under one hold of its grant and announced with
        one write of their DONE frames (fewer system calls, and fewer GIL hand-offs to the
        process's other threads, per layer)."""
        assert self._ring is not None
        ring = ring_array(self._ring)
        stop = False
        while not stop and not self.stopped.is_set():
            try:
                item = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                self._read_credit(sock, wait=False)  # also notices a receiver that went away
                continue
            if item is None:
                break
            batch, stop = self._batch(item)
            direct: list[tuple[SendItem, ShmDest]] = []
            for item in batch:
                if self.plane.is_cancelled(item.transfer_id):
                    continue
                dest = self.plane.take_dest(self.peer.instance_id, item.transfer_id, item.layer_index)
                if dest is not None and dest.region in self._regions.arrays:
                    if direct and (direct[0][1].slot, direct[0][1].token) != (dest.slot, dest.token):
                        self._write_direct(sock, direct)
                        direct = []
                    direct.append((item, dest))
                    continue
                self._write_direct(sock, direct)
                direct = []
                try:
                    self._write(sock, ring, item)
                except _Cancelled:
                    continue
                self.plane.callbacks.on_sent(self.peer.instance_id, item.transfer_id, (item.layer_index,))
            self._write_direct(sock, direct)

    def _batch(self, first: SendItem) -> tuple[list[SendItem], bool]:
        """``first`` and the layers queued behind it; True when the stop marker came up (after the
        batch). Unbounded: the caller queued them, the receiver is told of written layers every
        ``ANNOUNCE_S``, and a revoke waits for one layer at most (``grants``)."""
        batch = [first]
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return batch, False
            if item is None:
                return batch, True
            batch.append(item)

    def _write_direct(self, sock: socket.socket, layers: list[tuple[SendItem, ShmDest]]) -> None:
        """Copy layers of one transfer (one grant) straight into the receiver's granted blocks under
        one hold of the grant's lock, announcing them (DONE frames, reported sent) every
        ``ANNOUNCE_S`` and at the end. A layer whose runs do not fit fails its transfer; a revoked
        grant drops the layers not yet copied.

        One hold for the batch, not one per layer: each lock and unlock is a system call, where
        the writer lets go of the GIL and waits to get it back from the process's other threads
        (docs/decisions/111-shm-one-hold.md)."""
        if not layers:
            return
        assert self._grants is not None
        grant = layers[0][1]
        frames: list[bytes] = []
        done: list[int] = []
        announce_at = time.monotonic() + ANNOUNCE_S
        try:
            with self._grants.holding(grant.slot, grant.token, CANCEL_WAIT_S * 5) as granted:
                for item, dest in layers:
                    if not granted() or self.plane.is_cancelled(item.transfer_id):
                        return  # revoked: the receiver's blocks may be in use again
                    try:  # planned here, not for the batch up front: the first copy starts sooner
                        src, dst, runs = self._plan(item, dest)
                    except ValueError as exc:
                        self.plane.callbacks.on_transfer_failed(
                            item.transfer_id, f"mismatch: shared-memory layer {item.layer_index}: {exc}"
                        )
                        continue
                    self._copy(item.layer_index, src, dst, runs)
                    tid = item.transfer_id.encode()
                    total = _payload_bytes(item)  # the runs' total (pairing checked it)
                    frames.append(
                        FRAME.pack(Frame.DONE, item.layer_index, total, 0, 0, total, len(tid)) + tid
                    )
                    done.append(item.layer_index)
                    if time.monotonic() >= announce_at:
                        self._announce(sock, grant.transfer_id, frames, done)
                        announce_at = time.monotonic() + ANNOUNCE_S
        except TimeoutError as exc:
            raise ConnectionError(f"receiver kept its grant table locked: {exc}") from exc
        finally:  # what was written is announced, also when a later layer was revoked
            self._announce(sock, grant.transfer_id, frames, done)

    def _copy(self, layer: int, src: Bytes, dst: Bytes, runs: list[Run]) -> None:
        """One layer's runs into the granted destination; with the test hook set for ``layer``
        (``plane.STOP_MID_LAYER_ENV``) this process stops itself half way (SIGSTOP) and writes the
        rest once resumed: a sender stalled in the middle of a layer."""
        if layer != self.plane.stop_mid_layer:
            self.plane.copier.copy(src, dst, runs)
            return
        first, rest = halves(runs)
        self.plane.copier.copy(src, dst, first)
        # thread-directed: this thread stops on its way out of the system call (a SIGSTOP sent to
        # the process may be taken by another thread while this one copies on until a tick)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        self.plane.copier.copy(src, dst, rest)
        self._count("stopped_mid_layer")

    def _announce(
        self, sock: socket.socket, transfer_id: str, frames: list[bytes], layers: list[int]
    ) -> None:
        """Send the DONE frames of written ``layers`` and report them sent; empties both lists
        (first: a link that breaks meanwhile does not see them announced twice)."""
        if not frames:
            return
        data, sent = b"".join(frames), tuple(layers)
        frames.clear()
        layers.clear()
        self._count("one_copy", len(sent))  # before the frames: the layers may complete
        sock.sendall(data)
        self.plane.callbacks.on_sent(self.peer.instance_id, transfer_id, sent)

    def _plan(self, item: SendItem, dest: ShmDest) -> tuple[Bytes, Bytes, list[Run]]:
        """(source bytes, destination bytes, runs) of a one-copy layer; ValueError when they do not fit."""
        src_spans: Sequence[tuple[int, int]]
        if item.spans is not None:
            src, src_spans = self._sources.of(item.spans.base), item.spans.spans
        else:
            tensor = item.tensor if item.tensor.device.type == "cpu" else item.tensor.cpu()
            src = tensor_array(tensor)  # maybe a temporary copy: not kept
            src_spans = ((0, src.size),)
        region = self._regions.arrays[dest.region]
        if not 0 <= dest.base <= region.size:
            raise ValueError(f"destination base {dest.base} outside the region ({region.size} B)")
        dst = region[dest.base :]
        return src, dst, self._plans.runs(src_spans, dest.spans, src.size, dst.size)

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

    def _count(self, path: str, layers: int = 1) -> None:
        with self.plane.lock:
            self.plane.layers_sent[path] += layers

    def _reserve(self, sock: socket.socket, num_bytes: int, size: int) -> int:
        """Ring position for the next chunk, once the receiver has freed enough (waits for credit).
        Credits are drained before every chunk, not only when the ring is full: many small layers
        would otherwise fill the socket with unread credits until the receiver blocks writing one
        while this side blocks writing a frame."""
        self._read_credit(sock, wait=False)
        pos = next_slot(self._head, num_bytes, size)
        timeout_s = self.plane.config.links.link_timeout_s
        deadline = time.monotonic() + timeout_s
        while pos + num_bytes - self._consumed > size:
            if self.stopped.is_set():
                raise ConnectionError("plane closing")
            consumed = self._consumed
            self._read_credit(sock, wait=True)
            if self._consumed != consumed:
                deadline = time.monotonic() + timeout_s  # progress: the receiver is copying out
            elif time.monotonic() > deadline:
                raise TimeoutError(f"the receiver returned no ring credit for {timeout_s:g} s")
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
