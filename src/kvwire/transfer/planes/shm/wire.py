"""Wire format of the shared-memory plane's Unix socket (see :mod:`kvwire.transfer.planes.shm.plane`)."""

from __future__ import annotations

import socket
import struct

MAGIC = b"KVWS"
VERSION = 1
RING = struct.Struct("!Q")  # receiver -> sender, with the memfd (SCM_RIGHTS): ring bytes
# sender -> receiver per chunk: layer, layer bytes, offset in the layer, ring position, chunk bytes,
# transfer-id length (the id follows)
CHUNK = struct.Struct("!IQQQIH")
CREDIT = struct.Struct("!Q")  # receiver -> sender: ring position up to which bytes were consumed
CHUNK_BYTES = 1 << 20  # the most bytes one chunk carries (a ring holds several: they pipeline)


def abstract_name(address: str) -> str:
    """``@name`` (how the plane advertises itself) -> the Linux abstract socket name."""
    if not address.startswith("@"):
        raise ValueError(f"not a shared-memory plane address: {address!r}")
    return "\0" + address[1:]


def recv_ring_fd(sock: socket.socket) -> tuple[int, int]:
    """The receiver's ring header and descriptor: (ring bytes, fd)."""
    data, fds, _, _ = socket.recv_fds(sock, RING.size, 1)
    if not fds:
        raise ConnectionError("the receiver sent no ring descriptor")
    for extra in fds[1:]:
        socket.close(extra)
    while len(data) < RING.size:
        more = sock.recv(RING.size - len(data))
        if not more:
            socket.close(fds[0])
            raise ConnectionError("connection closed during the ring handshake")
        data += more
    return RING.unpack(data)[0], fds[0]
