"""Shared-memory data plane: CPU tensors between two processes of one host, in one copy or two.

Why not sockets: on one host the loopback socket is the bottleneck (the kernel copies every byte
twice and the TCP stack costs more than the copies). Two paths, chosen per destination:

* **one copy** (docs/decisions/080-shm-one-copy.md): the destination lies in a shared region
  (:mod:`kvwire.transfer.shared_memory`: the built-in engine's CPU KV cache). The receiver exports
  each region once per link (its memfd, at link setup) and grants (region, byte spans, grant slot);
  the sender copies its blocks straight into those spans and sends DONE. A cancel on the receiver
  revokes the grant under the slot's lock (``grants``; each sending peer has a grant table of its
  own, ``regions``, decision 127); when a stalled sender keeps the lock past
  the revoke wait, the grant is quarantined (``quarantine``): the transfer stays :meth:`unsettled`
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
"""

from __future__ import annotations

import collections
import dataclasses
import os
import socket
import threading
from collections.abc import Sequence

import torch

from kvwire.supervision import HealthBoard
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.planes.base import UnixLinkPlane, take_granted
from kvwire.transfer.planes.common.wire import CANCEL_WAIT_S, peer_pid, shutdown
from kvwire.transfer.planes.shm import run_copy
from kvwire.transfer.planes.shm.direct import RunCopier, ShmDest, decode_direct, encode_direct
from kvwire.transfer.planes.shm.grants import GrantTable
from kvwire.transfer.planes.shm.quarantine import Quarantine, Quarantined
from kvwire.transfer.planes.shm.recv import Inbound, Landing
from kvwire.transfer.planes.shm.regions import GrantRegions
from kvwire.transfer.planes.shm.send import Outbound
from kvwire.transfer.shared_memory import SharedArena, SharedRegion, region_of
from kvwire.transfer.types import PeerRef, RecvItem, SendItem

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
        run_copy.warn_if_python()  # at start, not at the first transfer
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
        self.dests: dict[tuple[str, int], tuple[str, ShmDest]] = {}
        self.copier = RunCopier(config.shm_copy_threads)
        # receive-budget buffers in shared memory too (a transfer offered before its blocks were
        # known lands there in one copy); one region, exported to every link like the KV cache
        self.arena = SharedArena(config.recv_budget_bytes) if config.recv_budget_bytes > 0 else None
        if self.arena is not None:
            self._export_locked(self.arena.region)
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
            for key in [k for k in self.dests if k[0] == transfer_id]:
                del self.dests[key]
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
            for key in [k for k, (pid, _) in self.dests.items() if pid == peer_instance_id]:
                del self.dests[key]
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
            for item in items:
                self.posted[(item.transfer_id, item.layer_index)] = (peer.instance_id, item)
                dest = self._direct_dest(peer.instance_id, item)
                if dest is not None:
                    self._pending.setdefault(peer.instance_id, []).append(dest)

    def register_memory(self, tensors: Sequence[torch.Tensor]) -> None:
        """Export the shared regions holding ``tensors`` (the engine's KV cache) to every link set
        up from now on, so even a peer's first transfer into them takes the one-copy path."""
        with self.lock:
            for tensor in tensors:
                found = region_of(tensor)
                if found is not None:
                    self._export_locked(found[0])

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
        found = region_of(base)
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
            for dest in dests:
                if dest.transfer_id not in self.cancelled:
                    self.dests[(dest.transfer_id, dest.layer)] = (peer.instance_id, dest)

    def take_dest(self, peer_id: str, transfer_id: str, layer: int) -> ShmDest | None:
        """The one-copy destination granted for a layer (removed), or None (use the ring)."""
        return take_granted(self.lock, self.dests, peer_id, (transfer_id, layer))
