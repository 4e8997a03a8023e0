"""What every plane's outbound link has in common (TCP, shared memory, CUDA IPC): one writer thread per
peer epoch, its queue of layers (None: stop), a stop flag, the socket it dialled, and the end of a
link that dies (queued transfers fail ``peer_lost``; see :func:`kvwire.transfer.planes.base.fail_queued`)
and of a writer that raises something a link's failure never raises (:func:`writer_bug`)."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from typing import ClassVar

from kvwire.supervision import HealthBoard, guarded
from kvwire.transfer.memory import PeerRef, SendItem
from kvwire.transfer.planes.common.wire import abstract_name


class OutboundLink:
    """Base of a plane's writer for one peer epoch; the subclass writes (``_run``) and names its
    plane (``kind``: "tcp", "shm", "ipc": thread names)."""

    kind: ClassVar[str]

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
    the writer). Its plane reports it with ``on_peer_failed`` at once, so that every transfer bound to
    the peer fails now, the layers the thread had taken off its queue included, instead of waiting
    out its lease; then the exception goes on to the thread's guard, which logs and counts it."""
    return f"peer_lost: {link}: its writer failed ({type(exc).__name__}: {exc})"
