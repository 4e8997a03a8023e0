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

import secrets
import socket
import threading
import time
from collections.abc import Sequence

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks
from kvwire.transfer.planes.shm.recv import Inbound, Landing, shutdown
from kvwire.transfer.planes.shm.send import Outbound
from kvwire.transfer.planes.shm.wire import abstract_name
from kvwire.transfer.planes.tcp.wire import CANCEL_MEMORY_S, CANCEL_WAIT_S, POLL_S
from kvwire.transfer.types import PeerRef, RecvItem, SendItem

_JOIN_S = 5.0


class ShmPlane(DataPlane):
    """Shared-memory data plane for CPU tensors of processes on one host."""

    ordered = False
    supports_spans = True

    def __init__(self, config: TransferConfig, instance_id: str) -> None:
        self.config = config
        self.instance_id = instance_id
        self.secret = config.secret
        self.lock = threading.Lock()
        self.written = threading.Condition(self.lock)
        self.closing = threading.Event()
        self.outbound: dict[str, Outbound] = {}
        self.inbound: dict[socket.socket, str] = {}  # connection -> peer instance id ("" = handshaking)
        self.readers: set[threading.Thread] = set()
        self.posted: dict[tuple[str, int], tuple[str, RecvItem]] = {}
        self.landing: dict[tuple[str, int], Landing] = {}  # layers whose first chunk arrived
        self.cancelled: dict[str, float] = {}
        self.writing: dict[socket.socket, str] = {}  # connection -> transfer being copied into caller memory
        self._listener: socket.socket | None = None
        self._address = ""
        self._acceptor: threading.Thread | None = None
        self._callbacks: PlaneCallbacks | None = None

    @property
    def callbacks(self) -> PlaneCallbacks:
        assert self._callbacks is not None, "start() first"
        return self._callbacks

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self, callbacks: PlaneCallbacks) -> None:
        self._callbacks = callbacks
        address = f"@kvwire-shm-{self.instance_id}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(abstract_name(address))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        listener.settimeout(POLL_S)
        self._listener, self._address = listener, address
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvwire-shm-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        assert self._address, "start() first"
        return self._address

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        with self.lock:
            outbound = list(self.outbound.values())
            inbound = list(self.inbound)
            self.posted.clear()
        for out in outbound:
            out.stop()
        for conn in inbound:
            shutdown(conn)
        if self._acceptor is not None:
            self._acceptor.join(timeout=_JOIN_S)
        for out in outbound:
            out.thread.join(timeout=_JOIN_S)
        with self.lock:
            readers = list(self.readers)
        for reader in readers:
            reader.join(timeout=_JOIN_S)
        if self._listener is not None:
            self._listener.close()

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

    def is_cancelled(self, transfer_id: str) -> bool:
        with self.lock:
            return transfer_id in self.cancelled

    def cancel(self, transfer_id: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.cancelled[transfer_id] = now
            if len(self.cancelled) > 4096:
                self.cancelled = {t: s for t, s in self.cancelled.items() if now - s < CANCEL_MEMORY_S}
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

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self.closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.closing.is_set():
                    return
                continue
            inbound = Inbound(self, conn)
            reader = threading.Thread(target=inbound.serve, name="kvwire-shm-recv", daemon=True)
            with self.lock:
                if self.closing.is_set():
                    conn.close()
                    return
                self.inbound[conn] = ""
                self.readers.add(reader)
            reader.start()
