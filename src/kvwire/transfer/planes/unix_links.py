"""What the same-host planes (``shm``, ``ipc``) share: a Linux abstract Unix socket that peers
connect to, one reader thread per inbound link, one writer per outbound peer, and the bookkeeping
of cancelled transfers. Each plane supplies its link classes (:meth:`UnixLinkPlane._inbound_link`)
and what it cleans up on close; the lifecycle below is the same for both.

The listener is bounded like the TCP plane's (:mod:`~kvwire.transfer.planes.admission`: connections
per listener and per peer process, the handshake deadline, back-off on EMFILE) and its acceptor is
supervised. After the hello every link's socket keeps a timeout, ``links.link_timeout_s``: a write to
a peer that stops reading fails after that long without progress. Readers treat a read timeout as an
idle moment (a dead peer shows as EOF: its descriptors close with its process).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Any, ClassVar, Protocol, TypeVar

from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.planes.admission import Admission, accept_loop, shutdown, start_reader, unix_peer
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks
from kvwire.transfer.planes.shm.wire import abstract_name
from kvwire.transfer.planes.tcp.wire import CANCEL_MEMORY_S, POLL_S

JOIN_S = 5.0  # a plane thread not gone by then is left (daemon) and logged by its owner
_MAX_CANCELLED = 4096  # cancelled ids kept before the old ones (past CANCEL_MEMORY_S) are dropped


class _Outbound(Protocol):
    thread: threading.Thread

    def stop(self) -> None: ...


class _Inbound(Protocol):
    def serve(self) -> None: ...


_Dest = TypeVar("_Dest")


def take_granted(
    lock: threading.Lock, table: dict[tuple[str, int], tuple[str, _Dest]], peer_id: str, key: tuple[str, int]
) -> _Dest | None:
    """Remove and return the destination a peer granted for ``key`` (transfer id, layer): None when
    there is none or another peer granted it (the sender then uses its fallback or fails the layer)."""
    with lock:
        entry = table.get(key)
        if entry is None or entry[0] != peer_id:
            return None
        del table[key]
    return entry[1]


class UnixLinkPlane(DataPlane):
    """Base of the planes whose links are abstract Unix sockets (one network namespace, one host)."""

    #: the plane's name in its socket address and thread names ("shm", "ipc")
    link_kind: ClassVar[str]

    def __init__(self, config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> None:
        self.config = config
        self.instance_id = instance_id
        self.secret = config.secret
        self.board = board if board is not None else HealthBoard()
        self.admission = Admission(self.link_kind, config.links, self.board)
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.outbound: dict[str, Any] = {}  # peer instance id -> the plane's outbound link
        self.inbound: dict[socket.socket, str] = {}  # connection -> peer instance id ("" = handshaking)
        self.readers: set[threading.Thread] = set()
        self.cancelled: dict[str, float] = {}  # transfer id -> when cancelled (time.monotonic())
        self._listener: socket.socket | None = None
        self._address = ""
        self._acceptor: SupervisedThread | None = None
        self._callbacks: PlaneCallbacks | None = None

    def _inbound_link(self, conn: socket.socket) -> _Inbound:
        """The plane's reader of one accepted connection (its ``serve`` runs on a thread of its own)."""
        raise NotImplementedError

    def _closing_locked(self) -> None:
        """Called once, under ``lock``, when close starts (drop what no thread may pick up any more)."""

    def _closed(self) -> None:
        """Called once after every plane thread was joined, before the listener closes."""

    @property
    def callbacks(self) -> PlaneCallbacks:
        assert self._callbacks is not None, "start() first"
        return self._callbacks

    def start(self, callbacks: PlaneCallbacks) -> None:
        self._callbacks = callbacks
        address = f"@kvwire-{self.link_kind}-{self.instance_id}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(abstract_name(address))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        listener.settimeout(POLL_S)
        self._listener, self._address = listener, address
        self._acceptor = SupervisedThread(
            f"kvwire-{self.link_kind}-accept",
            lambda: accept_loop(listener, self.admission, self.closing, unix_peer, self._serve),
            self.closing,
            board=self.board,
        ).start()

    @property
    def address(self) -> str:
        assert self._address, "start() first"
        return self._address

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        with self.lock:
            outbound: list[_Outbound] = list(self.outbound.values())
            inbound = list(self.inbound)
            self._closing_locked()
        for out in outbound:
            out.stop()
        for conn in inbound:
            shutdown(conn)
        if self._acceptor is not None:
            self._acceptor.stop(JOIN_S)
        for out in outbound:
            out.thread.join(timeout=JOIN_S)
        with self.lock:
            readers = list(self.readers)
        for reader in readers:
            reader.join(timeout=JOIN_S)
        self._closed()
        if self._listener is not None:
            self._listener.close()

    def is_cancelled(self, transfer_id: str) -> bool:
        with self.lock:
            return transfer_id in self.cancelled

    def _note_cancelled(self, transfer_id: str) -> None:
        """Remember a cancelled transfer (bounded). Caller holds ``lock``."""
        now = time.monotonic()
        self.cancelled[transfer_id] = now
        if len(self.cancelled) > _MAX_CANCELLED:
            self.cancelled = {t: s for t, s in self.cancelled.items() if now - s < CANCEL_MEMORY_S}

    def _serve(self, conn: socket.socket) -> None:
        """Start the reader of a connection the admission took on (acceptor thread)."""
        link = self._inbound_link(conn)
        start_reader(self, conn, f"kvwire-{self.link_kind}-recv", link.serve)
