"""Shared-memory data plane: CPU tensors between two processes of one host, through a memfd ring.

Why a ring and not sockets: on one host the loopback socket is the bottleneck (the kernel copies
every byte twice and the TCP stack costs more than the copies). Here the sender copies each byte
run of a layer straight from its tensor (or paged blocks) into a ring of shared memory and the
receiver copies it straight into the destination (the caller's paged blocks, or a receive buffer):
one memcpy per byte run on each side, overlapped chunk by chunk, no kernel copy of the payload
(docs/decisions/076-shm-plane.md).

Link (sender connects to the receiver's ``address``, ``@name``: a Linux abstract Unix socket, which
lives in the network namespace, so negotiation offers this plane only inside one namespace)::

    receiver -> sender   nonce (16 random bytes)
    sender -> receiver   "KVWS" version:u8 id_len:u16 instance_id hmac_sha256(secret, nonce+id)
    receiver -> sender   ring_bytes:u64 + the ring's memfd (SCM_RIGHTS)
    sender -> receiver   per chunk: layer:u32 layer_bytes:u64 layer_offset:u64 ring_pos:u64
                         num_bytes:u32 tid_len:u16 transfer_id      (bytes are in the ring)
    receiver -> sender   per chunk: consumed_ring_pos:u64           (credit)

Nothing has a name in /dev/shm: the ring is a memfd whose descriptor both ends close right after
mapping it, so the kernel frees it with the last mapping; a ``kill -9`` of either end leaks nothing
and leaves nothing to clean up on the next start. A dead peer shows as EOF on the socket
(``peer_lost``). Semantics otherwise as the TCP plane (unordered, spans, cancel waits for a chunk
being copied into caller memory). Threads: one acceptor; per inbound link a reader and a reporter;
one writer per peer.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.planes.shm.recv import Inbound, Landing, shutdown
from kvwire.transfer.planes.shm.send import Outbound
from kvwire.transfer.planes.tcp.wire import CANCEL_WAIT_S
from kvwire.transfer.planes.unix_links import UnixLinkPlane
from kvwire.transfer.types import PeerRef, RecvItem, SendItem

_JOIN_S = 5.0


class ShmPlane(UnixLinkPlane):
    """Shared-memory data plane for CPU tensors of processes on one host."""

    ordered = False
    supports_spans = True
    link_kind = "shm"

    def __init__(self, config: TransferConfig, instance_id: str) -> None:
        super().__init__()
        self.config = config
        self.instance_id = instance_id
        self.secret = config.secret
        self.written = threading.Condition(self.lock)
        self.posted: dict[tuple[str, int], tuple[str, RecvItem]] = {}
        self.landing: dict[tuple[str, int], Landing] = {}  # layers whose first chunk arrived
        self.writing: dict[socket.socket, str] = {}  # connection -> transfer being copied into caller memory

    # --- lifecycle (start, close, accepting links: UnixLinkPlane) --------------------------------

    def _inbound_link(self, conn: socket.socket) -> Inbound:
        return Inbound(self, conn)

    def _closing_locked(self) -> None:
        self.posted.clear()

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
        if out is not None:
            out.stop()
        for conn in inbound:
            shutdown(conn)

    # --- receiver side -----------------------------------------------------------------------------

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        with self.lock:
            for item in items:
                self.posted[(item.transfer_id, item.layer_index)] = (peer.instance_id, item)
