"""The IPC plane's threads: a writer and a completer per peer (copies into the peer's mapped memory;
DONE frames once they landed) and a reader per inbound link (DONE -> on_received). See
:mod:`kvwire.transfer.planes.ipc.plane`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvwire.errors import ProtocolError
from kvwire.supervision import SupervisedThread
from kvwire.transfer.memory import PeerRef, SendItem
from kvwire.transfer.planes.base import fail_queued
from kvwire.transfer.planes.common.hello import check_hello, prove_hello
from kvwire.transfer.planes.common.liveness import count_cut
from kvwire.transfer.planes.common.outbound import OutboundLink
from kvwire.transfer.planes.common.runs import spans_array, tile_runs
from kvwire.transfer.planes.common.wire import POLL_S, recv_bytes
from kvwire.transfer.planes.ipc.copy import LayerGroup, TileTable, compiled, launch, prepare
from kvwire.transfer.planes.ipc.gate import LaunchGate

if TYPE_CHECKING:
    from kvwire.transfer.planes.ipc.plane import IpcPlane

MAGIC = b"KVWI"
VERSION = 3  # 3: the hello names both epochs (decision 126)
DONE = struct.Struct("!HH")  # transfer-id length, layer count; the id, then the layers ("!H" each)
MAX_BATCH = 64  # layers copied before one synchronization
_TILE_CACHE = 64  # tile tables kept per link (one per span-set pair: about one per transfer)
_JOIN_S = 5.0
GPU_WAIT_S = 60.0  # a batch's copies not done on the GPU by then: its transfers fail, the link ends
_GPU_POLL_S = 50e-6
GPU_STUCK = f"deadline: IPC copies not done on the GPU within {GPU_WAIT_S:.0f} s"


def done_frame(transfer_id: str, layers: list[int]) -> bytes:
    tid = transfer_id.encode()
    return DONE.pack(len(tid), len(layers)) + tid + struct.pack(f"!{len(layers)}H", *layers)


@dataclasses.dataclass
class _Batch:
    """Copies enqueued together: what the completer reports once ``end`` has passed."""

    items: list[SendItem]
    start: torch.cuda.Event
    end: torch.cuda.Event
    num_bytes: int


def _passed(event: torch.cuda.Event, timeout_s: float) -> bool:
    """Wait for ``event`` on the GPU, at most ``timeout_s`` (polled: a CUDA event wait has no deadline)."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(_GPU_POLL_S)
    return True


class IpcOutbound(OutboundLink):
    """Writer and completer threads for one peer epoch. The writer maps the peer's allocations and
    enqueues a batch's copies (one kernel per group of layers sharing their spans); the completer
    waits for each batch on the GPU, then sends its DONE frames, so the next batch is enqueued while
    the previous one copies."""

    kind = "ipc"

    def __init__(self, plane: IpcPlane, peer: PeerRef) -> None:
        self.plane = plane
        super().__init__(peer, plane.board)
        self.completions: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self.gate: LaunchGate  # made by the writer thread, with its device current
        self._tiles: collections.OrderedDict[tuple[int, int], tuple[object, object, TileTable]] = (
            collections.OrderedDict()
        )
        self._completed = threading.Event()  # the completer's stop: set with its end marker
        self.completer = SupervisedThread(
            "kvwire-ipc-done",
            self._complete,
            self._completed,
            board=plane.board,
            on_dead=lambda _: self.stop(),  # nothing completes this link's copies: end it
        )

    def _connect(self) -> socket.socket:
        links = self.plane.config.links
        sock = self._dial_unix(links.handshake_timeout_s)
        prove_hello(sock, self.plane.secret, self.plane.instance_id, self.peer.instance_id, MAGIC, VERSION)
        sock.settimeout(links.link_timeout_s)  # DONE frames' write deadline
        return sock

    def _write_loop(self) -> None:
        torch.cuda.set_device(self.plane.device)
        stream = torch.cuda.Stream(self.plane.device)
        anchor = torch.empty(4, dtype=torch.int32, device=self.plane.device)
        self.gate = LaunchGate()
        sock = self._connect()
        self.completer.start()
        while not self.stopped.is_set():
            batch = self._next_batch(sock)
            if batch is None:
                break
            if batch:
                self._copy(stream, anchor, batch)

    def _link(self) -> str:
        return f"IPC link to {self.peer.endpoint}"

    def _peer_failed(self, reason: str) -> None:
        self.plane.callbacks.on_peer_failed(self.peer.instance_id, reason)

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

    def _copy(self, stream: torch.cuda.Stream, anchor: torch.Tensor, batch: list[SendItem]) -> None:
        """Enqueue the batch's copies on ``stream`` (one launch per span-set group) and hand the
        batch to the completer."""
        cb = self.plane.callbacks
        groups: dict[int, LayerGroup] = {}
        copied: list[SendItem] = []
        waited: set[int] = set()
        for item in batch:
            with torch.cuda.stream(stream):  # a new tile table uploads on the copy stream
                planned = self._plan(item)
            if isinstance(planned, str):
                cb.on_transfer_failed(item.transfer_id, planned)
                continue
            tiles, bases = planned
            group = groups.get(id(tiles))
            if group is None:
                group = groups[id(tiles)] = LayerGroup(tiles)
            group.bases.append(bases)
            copied.append(item)
            if item.ready_event is not None and id(item.ready_event) not in waited:
                waited.add(id(item.ready_event))
                stream.wait_event(item.ready_event)
        if not copied:
            return
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                launches = prepare(list(groups.values()), anchor)
                gated = compiled(launches, self.plane.tuning)
                with self.gate.held(stream) if gated else contextlib.nullcontext(False):
                    start.record(stream)  # device time: from here (the host's preparation is done)
                    launch(launches, anchor, self.plane.tuning)
                    end.record(stream)
            except Exception as exc:  # a launch that fails fails its transfers, not the link
                for item in copied:
                    cb.on_transfer_failed(item.transfer_id, f"mismatch: IPC copy failed: {exc}")
                return
        self.completions.put(_Batch(copied, start, end, sum(g.num_bytes for g in groups.values())))

    def _plan(self, item: SendItem) -> tuple[TileTable, tuple[int, int]] | str:
        """(tile table, (source base, destination base)) of one layer; an error text when it cannot
        be copied."""
        dest = self.plane.take_dest(self.peer.instance_id, item.transfer_id, item.layer_index)
        if dest is None:
            return f"mismatch: no IPC destination granted for layer {item.layer_index}"
        if not dest.handle:
            return "mismatch: the receiver's buffer for this layer is host memory (IPC needs GPU memory)"
        if item.spans is not None:
            src, src_spans = item.spans.flat(), item.spans.spans
        else:
            src = item.tensor.reshape(-1).view(torch.uint8)
            src_spans = ((0, src.numel()),)
        if src.device.type != "cuda":
            return "mismatch: the IPC plane sends device memory only"
        try:
            tiles = self._tile_table(src_spans, dest.spans)
            address = self.plane.imports.address(self.peer.instance_id, dest.handle)
        except Exception as exc:
            return f"mismatch: IPC layer {item.layer_index}: {exc}"
        return tiles, (src.data_ptr(), address + dest.shift)

    def _tile_table(self, src_spans: tuple[tuple[int, int], ...], dst_spans: np.ndarray) -> TileTable:
        """Tiles of one (source spans, destination spans) pair, computed once: a request's layers share
        both objects (``block_spans`` memoizes; a Grant's span sets are decoded once), so the key is
        their identity (both stay referenced by the cache entry, so the ids cannot be reused)."""
        key = (id(src_spans), id(dst_spans))
        entry = self._tiles.get(key)
        if entry is None:
            tiles = tile_runs(spans_array(src_spans), dst_spans, self.plane.tuning.tile_bytes)
            entry = self._tiles[key] = (src_spans, dst_spans, TileTable.build(tiles, self.plane.device))
            while len(self._tiles) > _TILE_CACHE:
                self._tiles.popitem(last=False)
        return entry[2]

    def _complete(self) -> None:
        """Completer body (supervised: restarted if it raises): each batch, once its copies passed on
        the GPU -> DONE frames, on_sent. Returns at the end marker."""
        cb = self.plane.callbacks
        stuck = False
        while True:
            batch = self.completions.get()
            if batch is None:
                return  # _finish set _completed first
            stuck = stuck or not _passed(batch.end, GPU_WAIT_S)  # every copy landed in D's memory
            if stuck:  # this batch and every later one fail at once; the link ends
                for tid in {item.transfer_id for item in batch.items}:
                    cb.on_transfer_failed(tid, GPU_STUCK)
                self.stop()
                continue
            cb.on_device_copy(batch.num_bytes, batch.start.elapsed_time(batch.end) / 1e3)
            layers: dict[str, list[int]] = {}
            for item in batch.items:
                layers.setdefault(item.transfer_id, []).append(item.layer_index)
            try:
                assert self.sock is not None
                self.sock.sendall(b"".join(done_frame(tid, ls) for tid, ls in layers.items()))
            except OSError as exc:
                if not self.stopped.is_set():
                    count_cut(self.board, exc)
                    cb.on_peer_failed(
                        self.peer.instance_id, f"peer_lost: IPC link to {self.peer.endpoint}: {exc}"
                    )
                self.stop()
                continue
            for tid, ls in layers.items():
                cb.on_sent(self.peer.instance_id, tid, ls)

    def _finish(self) -> None:
        plane = self.plane
        if self.completer.ident is not None:  # started (alive, or dead: still on the board)
            self._completed.set()
            self.completions.put(None)  # the completer reports what the GPU already copies, then ends
            self.completer.stop(_JOIN_S)
        with plane.lock:
            self.dead = True
            if plane.outbound.get(self.peer.instance_id) is self:
                del plane.outbound[self.peer.instance_id]
            with contextlib.suppress(Exception):
                plane.imports.close_peer(self.peer.instance_id)
        if self.sock is not None:
            self.sock.close()
        if not self.stopped.is_set():
            fail_queued(self.queue, plane.callbacks, "peer_lost: IPC link closed")


class IpcInbound:
    """Reader of one accepted link: authenticates, then turns DONE frames into on_received."""

    def __init__(self, plane: IpcPlane, conn: socket.socket) -> None:
        self.plane = plane
        self.conn = conn
        self.peer_id = ""

    def _handshake(self) -> None:
        conn = self.conn
        conn.settimeout(self.plane.admission.hello_timeout_s())
        plane = self.plane
        claim = check_hello(conn, plane.secret, MAGIC, VERSION, "IPC link")
        self.peer_id = plane.admission.bind(claim, plane.instance_id, plane.callbacks, "IPC link")
        self.plane.admission.authenticated(conn)
        conn.settimeout(None)  # this end only reads; a dead peer shows as EOF

    def serve(self) -> None:
        plane = self.plane
        error: BaseException | None = None
        try:
            self._handshake()
            with plane.lock:
                plane.inbound[self.conn] = self.peer_id
            while not plane.closing.is_set():
                tid_len, count = DONE.unpack(recv_bytes(self.conn, DONE.size))
                tid = recv_bytes(self.conn, tid_len).decode(errors="replace")
                layers = struct.unpack(f"!{count}H", recv_bytes(self.conn, 2 * count))
                landed = [layer for layer in layers if plane.done(self.peer_id, tid, layer)]
                if landed:
                    plane.callbacks.on_received(self.peer_id, tid, landed)
        except (ProtocolError, OSError, ConnectionError) as exc:
            error = exc
        finally:
            with plane.lock:
                plane.inbound.pop(self.conn, None)
            self.conn.close()
            plane.admission.release(self.conn)
        try:
            if isinstance(error, ProtocolError):
                plane.callbacks.on_protocol_error(f"IPC link refused: {error}")
            elif error is not None and self.peer_id and not plane.closing.is_set():
                plane.callbacks.on_peer_failed(self.peer_id, f"peer_lost: IPC link from peer broke: {error}")
        finally:
            del error
            with plane.lock:
                plane.readers.discard(threading.current_thread())
