"""What every data link's socket code shares: the wake-up and cancel timings, reads and writes of
whole buffers (with a link's heartbeat, :class:`~kvwire.transfer.planes.common.liveness.Heartbeat`),
the peer credentials of a Unix socket, and the abstract socket names of the same-host planes."""

from __future__ import annotations

import contextlib
import socket
import struct

from kvwire.transfer.planes.common.liveness import Heartbeat

POLL_S = 0.2  # how often idle threads check for close / a dead peer
CANCEL_MEMORY_S = 120.0  # a cancelled transfer id is remembered at least this long
CANCEL_WAIT_S = 1.0  # cancel waits this long for a frame being written into caller memory
IOV_BATCH = 512  # iovecs per sendmsg/recvmsg_into (Linux IOV_MAX is 1024)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def recv_exact(sock: socket.socket, view: memoryview, beat: Heartbeat | None = None) -> None:
    """Fill ``view`` from ``sock``; ConnectionError on EOF. With ``beat``, a read that times out (the
    socket's timeout) is an idle moment: the heartbeat pings or declares the link dead
    (TimeoutError); without it the timeout propagates."""
    got = 0
    total = len(view)
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got)
        except TimeoutError:
            if beat is None:
                raise
            beat.idle()
            continue
        if n == 0:
            raise ConnectionError("connection closed by peer")
        if beat is not None:
            beat.heard()
        got += n


def recv_bytes(sock: socket.socket, n: int, beat: Heartbeat | None = None) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), beat)
    return bytes(buf)


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Write every part with as few ``sendmsg`` calls (iovecs) as the kernel allows."""
    i = 0
    while i < len(parts):
        sent = sock.sendmsg(parts[i : i + IOV_BATCH])
        while i < len(parts) and sent >= len(parts[i]):
            sent -= len(parts[i])
            i += 1
        if sent:
            parts[i] = parts[i][sent:]


def recv_parts(sock: socket.socket, parts: list[memoryview], beat: Heartbeat | None = None) -> None:
    """Fill every part in order with ``recvmsg_into`` (the kernel scatters); ConnectionError on EOF;
    ``beat`` as in :func:`recv_exact`."""
    parts = [p for p in parts if len(p)]
    i = 0
    while i < len(parts):
        try:
            got = sock.recvmsg_into(parts[i : i + IOV_BATCH])[0]
        except TimeoutError:
            if beat is None:
                raise
            beat.idle()
            continue
        if got == 0:
            raise ConnectionError("connection closed by peer")
        if beat is not None:
            beat.heard()
        while i < len(parts) and got >= len(parts[i]):
            got -= len(parts[i])
            i += 1
        if got:
            parts[i] = parts[i][got:]


def shutdown(conn: socket.socket) -> None:
    """Shut both directions of ``conn`` (its reader's blocked read ends); an already closed socket
    is fine."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(creds)[1])


def peer_pid(conn: socket.socket) -> int | None:
    """The process id at the other end of a Unix socket (SO_PEERCRED); None once it is closed."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    return int(_UCRED.unpack(creds)[0])


def abstract_name(address: str) -> str:
    """``@name`` (how a same-host plane advertises itself) -> the Linux abstract socket name."""
    if not address.startswith("@"):
        raise ValueError(f"not a shared-memory plane address: {address!r}")
    return "\0" + address[1:]
