"""The one listener lifecycle every socket plane shares (TCP, shared memory, CUDA IPC): a bounded,
supervised acceptor, one reader thread per inbound link, one writer per outbound peer, the close
that stops them all, and the bookkeeping of cancelled transfers.

A plane supplies its listening socket (:meth:`ListenerPlane._open_listener`), how a connection's peer
is named for the per-peer cap (:meth:`ListenerPlane._peer`), the reader of an accepted connection
(:meth:`ListenerPlane._inbound_link`) and what it cleans up on close (:meth:`_closing_locked`,
:meth:`_closed`). The listener is bounded by :mod:`~kvwire.transfer.planes.common.admission`
(connections per listener and per peer, the handshake deadline, back-off on EMFILE;
docs/decisions/115-data-link-bounds.md) and its acceptor is a
:class:`~kvwire.supervision.SupervisedThread` (restarted with backoff, or marked dead on the board).

Threads: ``start``/``close``/``cancel`` run on the caller's thread; the acceptor and every reader
and writer on their own. ``lock`` guards ``outbound``, ``inbound``, ``readers`` and ``cancelled``.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import ClassVar, Generic, Protocol, TypeVar

from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks
from kvwire.transfer.planes.common.admission import Admission, accept_loop, start_reader
from kvwire.transfer.planes.common.wire import CANCEL_MEMORY_S, POLL_S, shutdown

JOIN_S = 5.0  # a plane thread not gone by then is left (daemon) and logged by its owner
MAX_CANCELLED = 4096  # cancelled ids kept before the old ones (past CANCEL_MEMORY_S) are dropped


class Outbound(Protocol):
    """A plane's writer for one peer epoch (:class:`~kvwire.transfer.planes.common.outbound.OutboundLink`)."""

    thread: threading.Thread

    def stop(self) -> None: ...


class Inbound(Protocol):
    """A plane's reader of one accepted connection."""

    def serve(self) -> None: ...


OutT = TypeVar("OutT", bound=Outbound)


class ListenerPlane(DataPlane, Generic[OutT]):
    """Base of the planes that accept links on a listening socket; ``OutT`` is the plane's writer."""

    #: the plane's name in its admission, socket address and thread names ("tcp", "shm", "ipc")
    link_kind: ClassVar[str]

    def __init__(self, config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> None:
        self.config = config
        self.instance_id = instance_id
        self.secret = config.secret
        self.board = board if board is not None else HealthBoard()
        self.admission = Admission(self.link_kind, config.links, self.board)
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.outbound: dict[str, OutT] = {}  # peer instance id -> the plane's outbound link
        self.inbound: dict[socket.socket, str] = {}  # connection -> peer instance id ("" = handshaking)
        self.readers: set[threading.Thread] = set()
        self.cancelled: dict[str, float] = {}  # transfer id -> when cancelled (time.monotonic())
        self._listener: socket.socket | None = None
        self._address = ""
        self._acceptor: SupervisedThread | None = None
        self._callbacks: PlaneCallbacks | None = None

    # --- what a plane supplies -------------------------------------------------------------------

    def _open_listener(self) -> tuple[socket.socket, str]:
        """A bound, listening socket and the address peers dial (called once, by :meth:`start`)."""
        raise NotImplementedError

    def _peer(self, conn: socket.socket, addr: object) -> str:
        """Who ``conn`` is for the per-peer cap (TCP: the remote IP; Unix sockets: the process)."""
        raise NotImplementedError

    def _inbound_link(self, conn: socket.socket) -> Inbound:
        """The plane's reader of one accepted connection (its ``serve`` runs on a thread of its own)."""
        raise NotImplementedError

    def _closing_locked(self) -> None:
        """Called once, under ``lock``, when close starts (drop what no thread may pick up any more)."""

    def _closed(self) -> None:
        """Called once after every plane thread was joined, before the listener closes."""

    # --- lifecycle -------------------------------------------------------------------------------

    @property
    def callbacks(self) -> PlaneCallbacks:
        assert self._callbacks is not None, "start() first"
        return self._callbacks

    def start(self, callbacks: PlaneCallbacks) -> None:
        self._callbacks = callbacks
        listener, address = self._open_listener()
        listener.settimeout(POLL_S)
        self._listener, self._address = listener, address
        self._acceptor = SupervisedThread(
            f"kvwire-{self.link_kind}-accept",
            lambda: accept_loop(listener, self.admission, self.closing, self._peer, self._serve),
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
            outbound: list[OutT] = list(self.outbound.values())
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

    # --- cancelled transfers ---------------------------------------------------------------------

    def is_cancelled(self, transfer_id: str) -> bool:
        with self.lock:
            return transfer_id in self.cancelled

    def _note_cancelled(self, transfer_id: str) -> None:
        """Remember a cancelled transfer (bounded). Caller holds ``lock``."""
        now = time.monotonic()
        self.cancelled[transfer_id] = now
        if len(self.cancelled) > MAX_CANCELLED:
            self.cancelled = {t: s for t, s in self.cancelled.items() if now - s < CANCEL_MEMORY_S}

    def _serve(self, conn: socket.socket) -> None:
        """Start the reader of a connection the admission took on (acceptor thread)."""
        link = self._inbound_link(conn)
        start_reader(self, conn, f"kvwire-{self.link_kind}-recv", link.serve)
