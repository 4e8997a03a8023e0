"""Shared-memory data plane: CPU tensors between two processes of one host, in one copy or two.

Why not sockets: on one host the loopback socket is the bottleneck (the kernel copies every byte
twice and the TCP stack costs more than the copies). Two paths, chosen per destination:

* **one copy** (docs/decisions/080-shm-one-copy.md): the destination lies in a shared region
  (:mod:`kvwire.transfer.memory`: the built-in engine's CPU KV cache). The receiver exports
  each region once per link (its memfd, at link setup) and grants (region, byte spans, grant slot);
  the sender copies its blocks straight into those spans and sends DONE. A cancel on the receiver
  revokes the grant under the slot's lock (:class:`GrantTable`; each sending peer has a grant table
  of its own, :class:`GrantRegions`, decision 127); when a stalled sender keeps the lock past
  the revoke wait, the grant is quarantined (:class:`Quarantine`): the transfer stays :meth:`unsettled`
  and its blocks out of use until the sender lets go or its process ends.
* **ring** (docs/decisions/076-shm-plane.md): any other destination (vLLM's caches, receive and
  spill buffers). The sender copies each byte run into a ring of shared memory and the receiver
  copies it out into the destination: one memcpy per byte run on each side, overlapped chunk by
  chunk.

Link (sender connects to the receiver's ``address``, ``@name``: a Linux abstract Unix socket, which
lives in the network namespace, so negotiation offers this plane only inside one namespace)::

    receiver -> sender   nonce (16 random bytes)
    sender -> receiver   "KVWS" version:u8 id_len:u16 instance_id hmac_sha256(secret, nonce+id)
    receiver -> sender   ring_bytes:u64 table_bytes:u64 regions:u16, per region id:u64 bytes:u64
                         + memfds [ring, this peer's grant table, regions...] (SCM_RIGHTS)
    sender -> receiver   per frame: kind:u8 layer:u32 layer_bytes:u64 layer_offset:u64 ring_pos:u64
                         num_bytes:u32 tid_len:u16 transfer_id
                         (CHUNK: bytes are in the ring; DONE: the layer is in its destination)
    receiver -> sender   per chunk: consumed_ring_pos:u64           (credit)
    control plane        the Grant's plane_info: DirectInfo (one-copy destinations, if any; layers
                         with equal spans share one span set)

Nothing has a name in /dev/shm: ring, grant table and regions are memfds, so the kernel frees each
with its last mapping/descriptor; a ``kill -9`` of either end leaks nothing and leaves nothing to
clean up on the next start. The sender unmaps a peer's regions when the peer epoch ends (EOF on the
socket, drop, close). A dead peer shows as EOF on the socket (``peer_lost``); a sender killed
mid-layer leaves that layer unreported (its transfer fails, the blocks are the caller's again).
Semantics otherwise as the TCP plane (unordered, spans, cancel waits for a chunk being copied
into caller memory, or for the grant's lock). Regions made after a link's setup reach that peer
through the ring until its next epoch. Threads: one acceptor; per inbound link a reader and a
reporter; one writer per peer; ``shm_copy_threads - 1`` copy helpers.

Two modules (docs/decisions/139-planes-in-few-modules.md). This one: the plane (:class:`ShmPlane`)
and its receiver half, in order: the reader of an inbound link (:class:`Inbound`), the grant table
the receiver claims and revokes slots in (:class:`GrantTable`), one table per sending peer
(:class:`GrantRegions`), and the grants a stalled sender may still write under
(:class:`Quarantine`). :mod:`kvwire.transfer.planes.shm.send`: the writer and the copies both halves
make (ring, run copier, the grant message, the slot locks).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvwire.errors import ProtocolError
from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.memory import (
    PeerRef,
    RecvItem,
    SendItem,
    SharedArena,
    SharedRegion,
    region_of,
    sealed_memfd,
)
from kvwire.transfer.planes.base import GrantedDests, UnixLinkPlane, take_granted
from kvwire.transfer.planes.common.hello import check_hello
from kvwire.transfer.planes.common.liveness import count_cut
from kvwire.transfer.planes.common.wire import CANCEL_WAIT_S, peer_pid, peer_uid, shutdown
from kvwire.transfer.planes.shm.send import (
    SLOT_BYTES,
    Bytes,
    Outbound,
    RunCopier,
    ShmDest,
    SpanCursor,
    create_ring,
    decode_direct,
    encode_direct,
    ring_array,
    slot_unheld,
    tensor_array,
    warn_if_python,
)
from kvwire.transfer.planes.shm.wire import CREDIT, FRAME, MAGIC, VERSION, Frame, send_setup

log = logging.getLogger("kvwire.transfer")
_JOIN_S = 5.0
#: test hook (docs/decisions/114-shm-revoke-quarantine.md): a sender process started with this set to
#: a layer index stops itself (SIGSTOP) half way through copying that layer on the one-copy path, so
#: a test can resume it after the receiver gave up on the transfer. Read once, when a plane is made.
STOP_MID_LAYER_ENV = "KVWIRE_TEST_SHM_STOP_MID_LAYER"


def _stop_mid_layer() -> int | None:
    value = os.environ.get(STOP_MID_LAYER_ENV, "")
    return int(value) if value.strip() else None


@dataclasses.dataclass
class _Grant:
    """A transfer's one-copy grant on the receiver: its slot in its peer's grant region and the
    layers still to land."""

    peer_id: str
    slot: int
    token: int
    pending: set[int]
    num_bytes: int = 0  # destination bytes granted so far (quarantined with the grant, if it comes to that)
    dests: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)  # their tensors


class ShmPlane(UnixLinkPlane[Outbound]):
    """Shared-memory data plane for CPU tensors of processes on one host."""

    ordered = False
    supports_spans = True
    early_grants = True  # a one-copy layer's runs must fit its granted spans (RunPlans)
    link_kind = "shm"

    def __init__(self, config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> None:
        super().__init__(config, instance_id, board)
        warn_if_python()  # at start, not at the first transfer
        self.written = threading.Condition(self.lock)
        self.posted: dict[tuple[str, int], tuple[str, RecvItem]] = {}
        self.landing: dict[tuple[str, int], Landing] = {}  # layers whose first chunk arrived
        self.writing: dict[socket.socket, str] = {}  # connection -> transfer being copied into caller memory
        # one-copy path, receiver side: regions exported to peers (region id -> (own fd dup, bytes)),
        # a grant table per sending peer, grants per transfer, destinations waiting for the next
        # plane_info to each peer
        self.grants = GrantRegions(config.links.max_connections, self.board)
        self.quarantine = Quarantine()  # grants a stalled sender may still write under (decision 114)
        self.exported: dict[int, tuple[int, int]] = {}
        self._granted: dict[str, _Grant] = {}
        self._pending: dict[str, list[ShmDest]] = {}
        # sender side: destinations granted by peers, (transfer, layer) -> (peer id, dest)
        self.dests: GrantedDests[ShmDest] = GrantedDests(self.board, config.links)
        self.copier = RunCopier(config.shm_copy_threads)
        # receive-budget buffers in shared memory too (a transfer offered before its blocks were
        # known lands there in one copy); one region, exported to every link like the KV cache
        self.arena = SharedArena(config.recv_budget_bytes) if config.recv_budget_bytes > 0 else None
        # the regions a grant lands in on a request's path, known here without the process-wide
        # lookup (``region_of``): the arena's and the registered caches' (decision 145); each with
        # what keeps it mapped for the plane's life (the arena, a cache tensor); by region id, once
        # each (every layer's cache tensors lie in the same one or two regions)
        self._own_regions: dict[int, tuple[SharedRegion, object]] = {}
        if self.arena is not None:
            self._export_locked(self.arena.region)
            self._own_regions[self.arena.region.region_id] = (self.arena.region, self.arena)
        #: layers this plane sent, by path ("one_copy", "ring"): tests and diagnostics
        self.layers_sent: collections.Counter[str] = collections.Counter()
        self.stop_mid_layer = _stop_mid_layer()  # test hook, sender side (STOP_MID_LAYER_ENV)

    # --- lifecycle (start, close, accepting links: UnixLinkPlane) --------------------------------

    def _inbound_link(self, conn: socket.socket) -> Inbound:
        return Inbound(self, conn)

    def _closing_locked(self) -> None:
        self.posted.clear()
        self.dests.clear()
        self._pending.clear()

    def allocate(self, num_bytes: int) -> torch.Tensor:
        buffer = self.arena.allocate(num_bytes) if self.arena is not None else None
        return buffer if buffer is not None else torch.empty(num_bytes, dtype=torch.uint8)

    def _closed(self) -> None:
        self.copier.close()
        if self.arena is not None:
            self.arena.close()
        with self.lock:
            for fd, _ in self.exported.values():
                os.close(fd)
            self.exported.clear()
            self._granted.clear()
            self.quarantine.clear()
            self.grants.close()

    # --- sender side -------------------------------------------------------------------------------

    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        with self.lock:
            if self.closing.is_set():
                return
            out = self.outbound.get(peer.instance_id)
            if out is None or out.dead:
                out = Outbound(self, peer)
                self.outbound[peer.instance_id] = out
                out.thread.start()
        for item in items:
            out.queue.put(item)

    def cancel(self, transfer_id: str) -> None:
        with self.lock:
            self._note_cancelled(transfer_id)
            for key in [k for k in self.posted if k[0] == transfer_id]:
                del self.posted[key]
            for key in [k for k in self.landing if k[0] == transfer_id]:
                del self.landing[key]
            self.dests.drop_transfer(transfer_id)
            for dests in self._pending.values():
                dests[:] = [d for d in dests if d.transfer_id != transfer_id]
            grant = self._granted.pop(transfer_id, None)
            if grant is not None:  # after this no write of the transfer starts (grants); one
                self._revoke_locked(transfer_id, grant, CANCEL_WAIT_S)  # still running: quarantined
            # a chunk being copied into the caller's memory ends before cancel returns (one chunk:
            # a memcpy of at most CHUNK_BYTES); the caller may reuse those blocks once it failed
            finished = self.written.wait_for(lambda: transfer_id not in self.writing.values(), CANCEL_WAIT_S)
            conns = [] if finished else [c for c, t in self.writing.items() if t == transfer_id]
        for conn in conns:
            shutdown(conn)

    def drop_peer(self, peer_instance_id: str) -> None:
        with self.lock:
            out = self.outbound.pop(peer_instance_id, None)
            inbound = [c for c, pid in self.inbound.items() if pid == peer_instance_id]
            for key in [k for k, (pid, _) in self.posted.items() if pid == peer_instance_id]:
                del self.posted[key]
            self.dests.drop_peer(peer_instance_id)
            self._pending.pop(peer_instance_id, None)
            for tid in [t for t, g in self._granted.items() if g.peer_id == peer_instance_id]:
                self._revoke_locked(tid, self._granted.pop(tid), CANCEL_WAIT_S)
        if out is not None:
            out.stop()
        for conn in inbound:
            shutdown(conn)

    # --- receiver side -----------------------------------------------------------------------------

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        with self.lock:
            self._post_locked(peer.instance_id, items)

    def post_grant(self, peer: PeerRef, items: Sequence[RecvItem]) -> tuple[str, bytes]:
        """:meth:`post_recv` and :meth:`local_info` under one hold of the lock."""
        with self.lock:
            self._post_locked(peer.instance_id, items)
            dests = self._pending.pop(peer.instance_id, None)
        return self._address, encode_direct(dests) if dests else b""

    def _post_locked(self, peer_id: str, items: Sequence[RecvItem]) -> None:
        for item in items:
            self.posted[(item.transfer_id, item.layer_index)] = (peer_id, item)
            dest = self._direct_dest(peer_id, item)
            if dest is not None:
                self._pending.setdefault(peer_id, []).append(dest)

    def register_memory(self, tensors: Sequence[torch.Tensor]) -> None:
        """Export the shared regions holding ``tensors`` (the engine's KV cache) to every link set
        up from now on, so even a peer's first transfer into them takes the one-copy path."""
        with self.lock:
            for tensor in tensors:
                found = region_of(tensor)
                if found is not None:
                    self._export_locked(found[0])
                    self._own_regions.setdefault(found[0].region_id, (found[0], tensor))

    def _region_of(self, tensor: torch.Tensor) -> tuple[SharedRegion, int] | None:
        """``region_of(tensor)``, looked up first among the plane's own regions (the arena, the
        registered caches); the process-wide table only for a tensor outside them."""
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            start = tensor.data_ptr()
            end = start + tensor.numel() * tensor.element_size()
            for region, _ in self._own_regions.values():
                if region.address <= start and end <= region.address + region.size:
                    return region, start - region.address
        return region_of(tensor)

    def _export_locked(self, region: SharedRegion) -> None:
        if region.region_id not in self.exported:
            # a descriptor of our own: the region's may close with its last tensor, ours keeps the
            # memory valid for peers that mapped it (and its number from being reused)
            self.exported[region.region_id] = (os.dup(region.fd), region.size)

    def _direct_dest(self, peer_id: str, item: RecvItem) -> ShmDest | None:
        """The one-copy destination of ``item`` when it lies in a shared region (caller holds the
        lock); None: it is received through the ring."""
        if item.dest_spans is not None:
            base, spans = item.dest_spans.base, item.dest_spans.spans
        else:
            base, spans = item.dest, ((0, item.num_bytes),)
        found = self._region_of(base)
        if found is None:
            return None
        region, shift = found
        self._export_locked(region)
        grant = self._granted.get(item.transfer_id)
        if grant is None:
            if self._stalled_locked(peer_id):
                return None  # a grant of this sender is quarantined: the ring puts no block at risk
            table = self.grants.for_grant(peer_id)  # this sender's region: no other peer maps it
            claimed = table.claim() if table is not None else None
            if table is not None and claimed is None and self._settle_locked(peer_id):
                claimed = table.claim()  # a slot came back from quarantine
            if claimed is None:
                return None  # every slot in use: this transfer takes the ring
            grant = self._granted[item.transfer_id] = _Grant(peer_id, *claimed, set())
        grant.pending.add(item.layer_index)
        grant.num_bytes += sum(n for _, n in spans)
        grant.dests.append(base)
        return ShmDest(
            item.transfer_id,
            item.layer_index,
            region.region_id,
            shift,
            grant.slot,
            grant.token,
            spans,
        )

    def exported_regions(self) -> list[tuple[int, int, int]]:
        """(region id, fd, bytes) of every region exported so far (sent at each link's setup)."""
        with self.lock:
            return [(rid, fd, size) for rid, (fd, size) in self.exported.items()]

    def landed_locked(self, transfer_id: str, layer: int) -> None:
        """A layer's bytes are all in place (caller holds the lock): retire the transfer's grant once
        none of its layers is outstanding."""
        grant = self._granted.get(transfer_id)
        if grant is None:
            return
        grant.pending.discard(layer)
        if not grant.pending:
            del self._granted[transfer_id]
            # every layer landed, so nothing more is written under the grant: no wait here (the
            # sender lets go right after its last DONE); a slot still held then comes back later
            self._revoke_locked("", grant, 0.0)

    def _revoke_locked(self, transfer_id: str, grant: _Grant, wait_s: float) -> None:
        """Revoke ``grant`` (caller holds the lock); quarantine it when its sender still holds the
        slot after ``wait_s``. ``transfer_id`` empty: the transfer finished (only the slot waits)."""
        table = self.grants.table(grant.peer_id)
        if table is None or table.revoke(grant.slot, wait_s):  # None only once closed
            self.grants.free_if_idle(grant.peer_id)
            return
        pid = next((peer_pid(c) for c, p in self.inbound.items() if p == grant.peer_id), None)
        keep = grant.dests if transfer_id else []  # a finished transfer's memory is its caller's
        entry = Quarantined(transfer_id, grant.peer_id, grant.slot, grant.num_bytes, pid, keep=keep)
        self.quarantine.add(entry)

    def _stalled_locked(self, peer_id: str) -> bool:
        """Whether a transfer of ``peer_id`` is still quarantined (tries to release them first)."""
        if not self.quarantine.holds_peer(peer_id):
            return False
        self._settle_locked(peer_id)
        return self.quarantine.holds_peer(peer_id)

    def _settle_locked(self, peer_id: str | None = None) -> bool:
        """Release quarantined slots nobody holds any more (of ``peer_id``, or all), freeing the
        regions that leaves idle; whether any was released."""
        released = self.quarantine.settle(self.grants, peer_id)
        for peer in {q.peer_id for q in released}:
            self.grants.free_if_idle(peer)
        return bool(released)

    def grant_region_for_link(self, peer_id: str) -> GrantTable:
        """The grant table to hand to a link of ``peer_id`` at its setup (its own region), held for
        it until :meth:`link_closed`."""
        with self.lock:
            return self.grants.for_link(peer_id)

    def link_closed(self, peer_id: str) -> None:
        """A link of ``peer_id`` ended: its region is freed unless grants or quarantined slots
        remain in it (those of a sender that ended are released here first)."""
        with self.lock:
            self._settle_locked(peer_id)
            self.grants.link_closed(peer_id)

    def unsettled(self) -> dict[str, int]:
        """Cancelled transfers whose sender may still write into their destinations (quarantined
        one-copy grants), with the bytes each covers; released ones are dropped first. Any thread."""
        with self.lock:
            if self.closing.is_set():
                return {}
            self._settle_locked()
            return self.quarantine.unsettled()

    def local_info(self, peer: PeerRef) -> bytes:
        with self.lock:
            dests = self._pending.pop(peer.instance_id, None)
        return encode_direct(dests) if dests else b""

    # --- sender side: one-copy destinations --------------------------------------------------------

    def on_peer_info(self, peer: PeerRef, info: bytes) -> None:
        try:
            dests = decode_direct(info)
        except ValueError as exc:
            self.callbacks.on_protocol_error(f"shared-memory plane info from {peer.endpoint}: {exc}")
            return
        with self.lock:
            live = [((d.transfer_id, d.layer), d) for d in dests if d.transfer_id not in self.cancelled]
            refused = self.dests.put(peer.instance_id, live)
        if refused:  # those layers go through the ring
            self.callbacks.on_protocol_error(
                f"shared-memory plane info from {peer.endpoint}: {refused} destination(s) over the cap")

    def take_dest(self, peer_id: str, transfer_id: str, layer: int) -> ShmDest | None:
        """The one-copy destination granted for a layer (removed), or None (use the ring)."""
        return take_granted(self.lock, self.dests, peer_id, (transfer_id, layer))


# =================================================================================================
# The reader: one thread per inbound link
# =================================================================================================

# Receiver half of the shared-memory plane: one reader thread per inbound peer connection.
#
# The reader authenticates the sender, creates this connection's ring (a memfd of
# ``config.shm_ring_bytes``) and passes it over with the sender's own grant table (its region) and
# the shared regions it exports (SCM_RIGHTS), then handles frames in order: a CHUNK is copied out of
# the ring into the posted destination (the caller's byte spans, or the receive buffer) and
# credited; a DONE says the sender wrote the whole layer straight into the destination (the one-copy
# path). Once a layer's bytes are all in place it is reported (from a second thread, so the caller's
# sink for layer i overlaps the copy of layer i+1, as on the TCP plane).

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
            posted, foreign = self._take_posted(key)
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
        posted, foreign = self._take_posted(key)
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

    def _take_posted(self, key: tuple[str, int]) -> tuple[tuple[str, RecvItem] | None, bool]:
        """The receive posted for ``key`` (transfer id, layer), removed, and whether the one posted
        belongs to another peer epoch: that one stays posted, neither filled nor dropped by a frame
        of this link (decision 126). Caller holds the lock."""
        posted = self.plane.posted.get(key)
        if posted is not None and posted[0] != self.peer_id:
            return None, True
        return self.plane.posted.pop(key, None), False

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


# =================================================================================================
# The grant table: the receiver's side
# =================================================================================================

DEFAULT_SLOTS = 4096  # transfers with one-copy grants outstanding at once (more: they use the ring)


class GrantTable:
    """One grant region of the receiver (one per sending peer): claims slots for transfers and
    revokes them."""

    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        self.fd = sealed_memfd("kvwire-shm-grants", slots * SLOT_BYTES)
        try:
            self._map = mmap.mmap(self.fd, slots * SLOT_BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self.tokens: npt.NDArray[np.uint64] = np.frombuffer(self._map, dtype=np.uint64)
        self.size = slots * SLOT_BYTES
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))

    def claim(self) -> tuple[int, int] | None:
        """A free slot armed with a new token: (slot, token); None when every slot is in use.
        Caller serializes (the plane's lock)."""
        if not self._free:
            return None
        slot = self._free.pop()
        token = secrets.randbits(63) | 1
        self.tokens[slot] = token
        return slot, token

    def in_use(self) -> int:
        """Slots claimed and not freed yet (granted, or waiting for a sender to let go)."""
        return self.slots - len(self._free)

    def revoke(self, slot: int, timeout_s: float) -> bool:
        """Zero the slot's token, then take its lock and free the slot: True once no sender writes
        under it any more; False when a sender held the lock past ``timeout_s`` (no new write
        starts, but one may still be running; the slot stays out of use until :meth:`try_release`
        succeeds). Zeroing first tells a sender holding the lock across layers to stop after the
        layer it is copying. ``timeout_s`` 0: one try, no wait."""
        self.tokens[slot] = 0
        held = slot_unheld(self.fd, slot, timeout_s)
        if held:
            self._free.append(slot)
        return held

    def try_release(self, slot: int) -> bool:
        """A slot whose revoke timed out (its token is zero already): take its lock without waiting
        and free the slot. True when nobody holds it any more: its sender let go, or its process
        ended (the kernel drops a dead holder's lock), so nothing writes under the grant again."""
        if not slot_unheld(self.fd, slot, 0.0):
            return False
        self._free.append(slot)
        return True

    def close(self) -> None:
        del self.tokens
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)


# =================================================================================================
# Grant regions: one grant table per sending peer
# =================================================================================================

# Grant regions: one grant table per sending peer, so no peer can touch another's grants.
#
# A grant table (:class:`GrantTable`) is shared memory the sender maps writable: it must be, since the
# sender takes its slot locks on it and a revoke is only confirmed through those locks. With one
# table for every link, any peer that passed the hello could zero another peer's tokens (its
# transfers stop: a denial of service) or hold another peer's slot locks (its revokes never confirm:
# its blocks stay quarantined). Here each peer instance gets a table of its own, its *region*: its
# grants are claimed only there, its link's setup hands over only that one, and a revoke or a
# quarantine release looks only there (docs/decisions/127-shm-grant-regions.md).
#
# Regions are bounded: a link's setup makes its peer's region if there is none (live links are
# capped by the listener's ``max_connections``); a grant made before the peer linked (its first
# transfer) makes one only while fewer than ``max_connections`` exist, otherwise that transfer takes
# the ring (``kvwire_limit_hits_total{limit="shm_grant_regions_full"}``). So at most twice the
# listener cap exist at once. A region is freed once its peer has no live link, no grant outstanding
# and nothing quarantined in it (a quarantined slot keeps its region until it settles, decision 114).
# Not thread-safe: the plane's lock guards it.

REGIONS_FULL = "shm_grant_regions_full"  # kvwire_limit_hits_total{limit}: a grant sent to the ring


class GrantRegions:
    """The receiver's grant tables, by peer instance id."""

    def __init__(self, max_regions: int, board: HealthBoard, slots: int = DEFAULT_SLOTS) -> None:
        self.max_regions = max_regions
        self._board = board
        self._slots = slots
        self._tables: dict[str, GrantTable] = {}
        self._links: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._tables)

    def table(self, peer_id: str) -> GrantTable | None:
        """``peer_id``'s region, if it has one."""
        return self._tables.get(peer_id)

    def for_link(self, peer_id: str) -> GrantTable:
        """A link of ``peer_id`` is being set up: its region (made if needed), counted as in use
        until :meth:`link_closed`."""
        self._links[peer_id] += 1
        return self._make(peer_id)

    def link_closed(self, peer_id: str) -> None:
        """A link counted by :meth:`for_link` ended: its region is freed if nothing else holds it."""
        self._links[peer_id] -= 1
        if self._links[peer_id] <= 0:
            del self._links[peer_id]
            self.free_if_idle(peer_id)

    def for_grant(self, peer_id: str) -> GrantTable | None:
        """The region to claim a grant of ``peer_id`` in; None when it has none and the cap is
        reached (that transfer takes the ring)."""
        table = self._tables.get(peer_id)
        if table is not None:
            return table
        if len(self._tables) >= self.max_regions:
            self._board.limit_hit(REGIONS_FULL)
            return None
        return self._make(peer_id)

    def free_if_idle(self, peer_id: str) -> None:
        """Free ``peer_id``'s region when no link of it is live and none of its slots is in use (a
        grant outstanding, or a quarantined one: its slot is not free until it settles)."""
        table = self._tables.get(peer_id)
        if table is None or self._links.get(peer_id, 0) > 0 or table.in_use():
            return
        del self._tables[peer_id]
        table.close()

    def close(self) -> None:
        for table in self._tables.values():
            table.close()
        self._tables.clear()
        self._links.clear()

    def _make(self, peer_id: str) -> GrantTable:
        table = self._tables.get(peer_id)
        if table is None:
            table = self._tables[peer_id] = GrantTable(self._slots)
        return table


# =================================================================================================
# Quarantine: grants a stalled sender may still write under
# =================================================================================================

# Quarantine: one-copy grants whose revoke was not confirmed, and the receiver memory they cover.
#
# On the one-copy path a sender writes straight into the receiver's blocks under a grant
# (:class:`GrantTable`). A revoke zeroes the grant's token and waits up to ``CANCEL_WAIT_S`` for the
# slot's lock: a sender stalled in the middle of a layer for longer than that (stopped, swapped out,
# a big layer on a busy box) still holds the lock and will finish copying that layer whenever it runs
# again. Until it lets go, the transfer's destination blocks must not be reused, or that late copy
# lands in another request's KV (docs/decisions/114-shm-revoke-quarantine.md).
#
# Such a grant is *quarantined* here: its slot stays out of use and its transfer is reported
# unsettled (:meth:`ShmPlane.unsettled`), so the connector keeps the blocks from the engine's pool.
# Quarantine ends only on proof that nothing writes under the grant any more: its slot lock can be
# taken, which happens once the sender let go of it (finished or stopped the layer) or its process
# ended (the kernel drops the lock of a dead holder). A finished transfer's slot whose sender had not
# let go yet when the last layer landed is parked here too (``transfer_id`` empty): its data is all
# in place, so nothing waits for it; only the slot comes back later. Slots are those of the
# sender's own grant region (:class:`GrantRegions`), which a quarantined slot keeps alive until it settles.
# Not thread-safe: the plane's lock guards it.


@dataclasses.dataclass
class Quarantined:
    """A grant slot a sender may still write under."""

    transfer_id: str  # "" for a finished transfer's slot (not unsettled: its layers all landed)
    peer_id: str
    slot: int  # in ``peer_id``'s grant region
    num_bytes: int  # destination bytes the grant covers (what stays out of use)
    sender_pid: int | None  # the sender's process (SO_PEERCRED of its link), for the log
    since: float = dataclasses.field(default_factory=time.monotonic)
    # the destination tensors: kept alive, so a receive buffer of the shared arena (which returns
    # to the arena with its last tensor) is not handed out again while the sender may write into it
    keep: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)


class Quarantine:
    """The receiver's quarantined grants, by (peer, slot)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], Quarantined] = {}

    def add(self, entry: Quarantined) -> None:
        self._held[(entry.peer_id, entry.slot)] = entry
        if entry.transfer_id:
            log.warning(
                "shared-memory grant of transfer %s: sender %s (pid %s) still holds slot %d after "
                "the revoke wait; its %d destination bytes stay quarantined until it lets go or exits",
                entry.transfer_id, entry.peer_id[:8], entry.sender_pid, entry.slot, entry.num_bytes,
            )  # fmt: skip

    def settle(self, regions: GrantRegions, peer_id: str | None = None) -> list[Quarantined]:
        """Try every quarantined slot (of ``peer_id``, or all) without waiting, each in its
        sender's region; return and forget those nobody holds any more (their slots are free)."""
        released = [
            q for q in self._held.values()
            if (peer_id is None or q.peer_id == peer_id) and _release(regions, q)
        ]  # fmt: skip
        for q in released:
            del self._held[(q.peer_id, q.slot)]
            if q.transfer_id:
                log.info(
                    "shared-memory grant of transfer %s released by sender %s after %.3f s: its %d "
                    "destination bytes may be reused",
                    q.transfer_id, q.peer_id[:8], time.monotonic() - q.since, q.num_bytes,
                )  # fmt: skip
        return released

    def unsettled(self) -> dict[str, int]:
        """Transfer id -> destination bytes, of every quarantined transfer."""
        return {q.transfer_id: q.num_bytes for q in self._held.values() if q.transfer_id}

    def holds_peer(self, peer_id: str) -> bool:
        """Whether a transfer of ``peer_id`` is quarantined (that sender is stalled)."""
        return any(q.peer_id == peer_id and q.transfer_id for q in self._held.values())

    def holds_region(self, peer_id: str) -> bool:
        """Whether any slot of ``peer_id``'s region is quarantined (finished transfers' too)."""
        return any(q.peer_id == peer_id for q in self._held.values())

    def clear(self) -> None:
        self._held.clear()


def _release(regions: GrantRegions, entry: Quarantined) -> bool:
    table = regions.table(entry.peer_id)
    return table is None or table.try_release(entry.slot)  # no region: nothing left to write under
