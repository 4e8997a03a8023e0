"""Who may hold a connection on a data-plane listener, and the accept loop every plane shares.

A data-plane listener accepts before the peer proved anything (the hello comes after), and each
accepted connection gets a reader thread. So the listener caps what anyone who can reach the port
holds: at most ``max_connections`` connections at once and ``max_connections_per_peer`` from one
peer address; a connection over a cap is closed at once, before any thread starts. A connection
that has not finished its hello ``handshake_timeout_s`` after it was accepted is shut down by the
accept loop (which wakes every ``POLL_S``), however slowly it trickles bytes: a per-read timeout
alone would let a peer sending a byte a second hold its thread for ever.

When the process runs out of descriptors (EMFILE/ENFILE) the kernel keeps the connection queued and
every ``accept`` fails at once: the loop backs off (doubling to ``ACCEPT_BACKOFF_MAX_S``) instead of
spinning. Each refusal is counted on the :class:`~kvwire.supervision.HealthBoard`
(``kvwire_limit_hits_total{limit}``) and logged at most once per ``LOG_EVERY_S`` per kind.
(docs/decisions/115-data-link-bounds.md)
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvwire.http.refusal_log import RefusalLog
from kvwire.supervision import HealthBoard, guarded
from kvwire.transfer.planes.common.hello import LinkRefused, PeerEpochs, bind_hello
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.common.liveness import LINK_TIMEOUT
from kvwire.transfer.planes.common.wire import peer_pid, shutdown

log = logging.getLogger("kvwire.transfer")

POLL_S = 0.2  # the accept loop's wake-up: closing, and connections past their handshake deadline
ACCEPT_BACKOFF_MAX_S = 1.0
# A read of the hello may wait this long past the handshake deadline: the accept loop's sweep (at
# most POLL_S late) is what cuts and counts a late hello, whether it trickles or sends nothing.
HANDSHAKE_GRACE_S = 1.0
LOG_EVERY_S = 10.0
_FD_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# a connection that went away between the kernel's accept and ours: nothing wrong with the listener
_TRANSIENT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EPERM, errno.EAGAIN})

# kvwire_limit_hits_total{limit} names
LISTENER_FULL = "data_listener_full"
PEER_FULL = "data_peer_full"
HANDSHAKE_TIMEOUT = "data_handshake_timeout"
FD_EXHAUSTED = "data_accept_fd_exhausted"
NO_THREAD = "data_accept_no_thread"
LINK_REFUSED = "data_link_refused"  # an authenticated hello of an epoch the control plane does not hold
LIMITS = (LISTENER_FULL, PEER_FULL, HANDSHAKE_TIMEOUT, FD_EXHAUSTED, NO_THREAD, LINK_REFUSED)


@dataclasses.dataclass
class _Slot:
    peer: str
    deadline: float | None  # handshake deadline; None once authenticated (or already cut)


class Admission:
    """The connections one listener holds, by peer, and their handshake deadlines. Thread-safe."""

    def __init__(self, what: str, limits: DataLinkConfig, board: HealthBoard) -> None:
        self.what = what  # "tcp", "shm", "ipc": in logs
        self.limits = limits
        self.board = board
        self._lock = threading.Lock()
        self._slots: dict[socket.socket, _Slot] = {}
        self._per_peer: collections.Counter[str] = collections.Counter()
        self.log = RefusalLog(log, f"{what} data connection", interval_s=LOG_EVERY_S)
        for limit in (*LIMITS, LINK_TIMEOUT):  # exported at 0 before the first hit: alerts can name them
            board.limit_hit(limit, 0)

    def admit(self, conn: socket.socket, peer: str) -> bool:
        """Take ``conn`` on (True) or refuse it (False: the caller closes it; counted, logged)."""
        with self._lock:
            if len(self._slots) >= self.limits.max_connections:
                refused, cap = LISTENER_FULL, f"{self.limits.max_connections} connections"
            elif self._per_peer[peer] >= self.limits.max_connections_per_peer:
                refused, cap = PEER_FULL, f"{self.limits.max_connections_per_peer} connections from {peer}"
            else:
                deadline = time.monotonic() + self.limits.handshake_timeout_s
                self._slots[conn] = _Slot(peer, deadline)
                self._per_peer[peer] += 1
                return True
        self.board.limit_hit(refused)
        self.log.refused(refused, f"the {self.what} data listener holds {cap} already")
        return False

    def bind(self, claim: tuple[str, str], instance_id: str, control: PeerEpochs, what: str) -> str:
        """The peer epoch of a hello that proved the secret, bound to the control plane
        (:func:`~kvwire.transfer.planes.common.hello.bind_hello`); a refusal is counted and raised (the
        reader reports it as a protocol error and closes the link)."""
        try:
            return bind_hello(claim, instance_id, control, what)
        except LinkRefused:
            self.board.limit_hit(LINK_REFUSED)
            raise

    def authenticated(self, conn: socket.socket) -> None:
        """``conn`` finished its hello: off the handshake clock."""
        with self._lock:
            slot = self._slots.get(conn)
            if slot is not None:
                slot.deadline = None

    def release(self, conn: socket.socket) -> None:
        """``conn`` ended (its reader's last step)."""
        with self._lock:
            slot = self._slots.pop(conn, None)
            if slot is not None:
                self._per_peer[slot.peer] -= 1
                if self._per_peer[slot.peer] <= 0:
                    del self._per_peer[slot.peer]

    def no_thread(self, conn: socket.socket, error: BaseException) -> None:
        """``conn`` was taken on but its reader thread could not start: released, counted, logged."""
        self.release(conn)
        self.board.limit_hit(NO_THREAD)
        self.log.refused(NO_THREAD, f"no reader thread ({error})")

    def overdue(self) -> list[socket.socket]:
        """Connections past their handshake deadline (each returned once; counted)."""
        now = time.monotonic()
        with self._lock:
            late = [(c, s) for c, s in self._slots.items() if s.deadline is not None and s.deadline < now]
            for _, slot in late:
                slot.deadline = None
        if late:
            self.board.limit_hit(HANDSHAKE_TIMEOUT, len(late))
            self.log.refused(HANDSHAKE_TIMEOUT, f"{len(late)} connection(s) did not finish the hello "
                             f"within {self.limits.handshake_timeout_s:.1f} s")
        return [c for c, _ in late]

    def hello_timeout_s(self) -> float:
        """The socket timeout of a reader during the hello (see ``HANDSHAKE_GRACE_S``)."""
        return self.limits.handshake_timeout_s + HANDSHAKE_GRACE_S

    def held(self) -> int:
        with self._lock:
            return len(self._slots)


def tcp_peer(conn: socket.socket, addr: object) -> str:
    """A TCP connection's peer address for the per-peer cap: the remote IP."""
    del conn
    return str(addr[0]) if isinstance(addr, tuple) and addr else "?"


def unix_peer(conn: socket.socket, addr: object) -> str:
    """A Unix-socket connection's peer for the per-peer cap: its process (SO_PEERCRED)."""
    del addr
    pid = peer_pid(conn)
    return "?" if pid is None else f"pid {pid}"


def accept_loop(
    listener: socket.socket,
    admission: Admission,
    closing: threading.Event,
    peer_of: Callable[[socket.socket, object], str],
    serve: Callable[[socket.socket], None],
) -> None:
    """Accept until ``closing`` is set (the body of a plane's supervised acceptor; ``listener`` has a
    ``POLL_S`` timeout). ``serve(conn)`` starts the connection's reader (which calls
    ``admission.authenticated`` after the hello and ``admission.release`` at its end); an unexpected
    ``accept`` error raises (the supervisor restarts the loop with backoff, or marks it dead)."""
    backoff_s = 0.0
    while not closing.is_set():
        for conn in admission.overdue():
            shutdown(conn)  # its reader's recv ends; the reader reports and releases it
        try:
            conn, addr = listener.accept()
        except TimeoutError:
            continue
        except OSError as exc:
            if closing.is_set():
                return
            if exc.errno in _TRANSIENT:
                continue
            if exc.errno not in _FD_EXHAUSTED:
                raise
            backoff_s = min(max(2 * backoff_s, 0.05), ACCEPT_BACKOFF_MAX_S)
            admission.board.limit_hit(FD_EXHAUSTED)
            admission.log.refused(FD_EXHAUSTED, f"cannot accept ({exc}): backing off {backoff_s:.2f} s")
            closing.wait(backoff_s)
            continue
        backoff_s = 0.0
        if admission.admit(conn, peer_of(conn, addr)):
            serve(conn)
        else:
            conn.close()


class ListeningPlane(Protocol):
    """What :func:`start_reader` needs of a plane with a listener (TCP, the Unix-socket links)."""

    lock: threading.Lock
    closing: threading.Event
    admission: Admission
    inbound: dict[socket.socket, str]
    readers: set[threading.Thread]
    board: HealthBoard


def start_reader(plane: ListeningPlane, conn: socket.socket, name: str, serve: Callable[[], None]) -> None:
    """Start ``serve`` (the reader of a connection the admission took on) on its own guarded thread,
    tracked in ``plane.readers``; a plane closing, or no thread to be had (the process's limit),
    refuses the connection instead. Acceptor thread."""
    reader = threading.Thread(target=guarded(name, serve, plane.board), name=name, daemon=True)
    with plane.lock:
        if plane.closing.is_set():
            conn.close()
            plane.admission.release(conn)
            return
        plane.inbound[conn] = ""
        plane.readers.add(reader)
    try:
        reader.start()
    except RuntimeError as exc:  # no thread to be had: refuse this one
        with plane.lock:
            plane.inbound.pop(conn, None)
            plane.readers.discard(reader)
        conn.close()
        plane.admission.no_thread(conn, exc)
