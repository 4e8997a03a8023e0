"""What every plane's outbound link has in common (TCP, shared memory, CUDA IPC): one writer thread per
peer epoch, its queue of layers (None: stop), a stop flag, the socket it dialled, and the end of a
link that dies (its peer's transfers fail ``peer_lost``; queued ones too, see
:func:`kvwire.transfer.planes.base.fail_queued`), also when the writer itself raises (:func:`writer_bug`)."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from typing import ClassVar

from kvwire.supervision import HealthBoard, guarded
from kvwire.transfer.memory import PeerRef, SendItem
from kvwire.transfer.planes.common.liveness import count_cut
from kvwire.transfer.planes.common.wire import abstract_name


class OutboundLink:
    """Base of a plane's writer for one peer epoch; the subclass writes (``_run``) and names its
    plane (``kind``: "tcp", "shm", "ipc": thread names)."""

    kind: ClassVar[str]
    link_errors: ClassVar[tuple[type[Exception], ...]] = (OSError, ConnectionError)  # the link broke

    def __init__(self, peer: PeerRef, board: HealthBoard) -> None:
        self.peer = peer
        self.board = board
        self.queue: queue.SimpleQueue[SendItem | None] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.dead = False  # set under the plane's lock when the thread gives up
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(
            target=guarded(f"kvwire-{self.kind}-send", self._run, board),
            name=f"kvwire-{self.kind}-send-{peer.instance_id[:8]}",
            daemon=True,
        )

    def _run(self) -> None:
        """The writer thread: :meth:`_write_loop` until it returns or raises. A link error
        (``link_errors``) fails the peer's transfers, ``peer_lost: <link>: <error>``. Anything else is
        a bug in the writer: the peer's transfers fail too (:func:`writer_bug`; the layers the thread
        had taken off its queue would otherwise wait out their lease) and the exception goes on to
        the thread's guard, which logs and counts it. The link's end is counted and :meth:`_finish`
        runs either way."""
        error: BaseException | None = None
        try:
            self._write_loop()
        except self.link_errors as exc:
            if not self.stopped.is_set():
                error = exc
                self._peer_failed(f"peer_lost: {self._link()}: {exc}")
        except Exception as exc:
            if not self.stopped.is_set():
                self._peer_failed(writer_bug(self._link(), exc))
            raise
        finally:
            count_cut(self.board, error)
            del error
            self._finish()

    def _write_loop(self) -> None:
        """Connect, then write queued layers until stopped (the subclass's plane)."""
        raise NotImplementedError

    def _link(self) -> str:
        """The link as failure reasons name it (``shared-memory link to <endpoint>``)."""
        raise NotImplementedError

    def _peer_failed(self, reason: str) -> None:
        """Report ``reason`` for the peer to the plane's agent (``on_peer_failed``)."""
        raise NotImplementedError

    def _finish(self) -> None:
        """The link's end: unregistered from its plane, closed, what is still queued failed."""
        raise NotImplementedError

    def stop(self) -> None:
        """Ask the thread to end: it sees None in its queue, or its socket shut down mid-write."""
        self.stopped.set()
        self.queue.put(None)
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _dial_unix(self, handshake_timeout_s: float) -> socket.socket:
        """Connect to the peer's abstract Unix socket (shared-memory and IPC links), handshake timeout
        set (the caller authenticates, then sets the link's write deadline)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = sock
        sock.settimeout(handshake_timeout_s)
        sock.connect(abstract_name(self.peer.data_address))
        return sock


def writer_bug(link: str, exc: BaseException) -> str:
    """The ``peer_lost`` reason of a writer thread that raised what no link failure raises (a bug in
    the writer; :meth:`OutboundLink._run`)."""
    return f"peer_lost: {link}: its writer failed ({type(exc).__name__}: {exc})"
