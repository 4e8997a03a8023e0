"""Wire format of the shared-memory plane's Unix socket (see :mod:`kvwire.transfer.planes.shm.plane`)."""

from __future__ import annotations

import enum
import socket
import struct

MAGIC = b"KVWS"
VERSION = 3  # 3: the hello names both epochs (decision 126)
# receiver -> sender after the hello, with descriptors (SCM_RIGHTS) [ring, grant table, regions...]:
# ring bytes, grant-table bytes, number of shared regions; then per region: region id, bytes
SETUP = struct.Struct("!QQH")
REGION = struct.Struct("!QQ")
MAX_REGIONS = 250  # descriptors in one message: the kernel takes at most 253
# sender -> receiver per frame: kind, layer, layer bytes, offset in the layer, ring position, bytes,
# transfer-id length (the id follows). A DONE frame (one-copy path) has offset 0, ring position 0
# and bytes = layer bytes: the whole layer is in the receiver's memory already.
FRAME = struct.Struct("!BIQQQIH")
CREDIT = struct.Struct("!Q")  # receiver -> sender: ring position up to which bytes were consumed
CHUNK_BYTES = 1 << 20  # the most bytes one chunk carries (a ring holds several: they pipeline)


class Frame(enum.IntEnum):
    CHUNK = 1  # bytes of a layer are in the ring
    DONE = 2  # a whole layer was written straight into the receiver's shared memory


def send_setup(
    sock: socket.socket, ring: tuple[int, int], table: tuple[int, int], regions: list[tuple[int, int, int]]
) -> None:
    """Receiver: the ring and grant table as (fd, bytes), the exported regions as (id, fd, bytes)."""
    regions = regions[:MAX_REGIONS]
    data = SETUP.pack(ring[1], table[1], len(regions)) + b"".join(REGION.pack(r, n) for r, _, n in regions)
    socket.send_fds(sock, [data], [ring[0], table[0], *(fd for _, fd, _ in regions)])


def recv_setup(sock: socket.socket) -> tuple[tuple[int, int], tuple[int, int], dict[int, tuple[int, int]]]:
    """Sender: ((ring fd, bytes), (table fd, bytes), {region id: (fd, bytes)}). The caller owns
    every descriptor returned; on error none is left open."""
    data, fds, _, _ = socket.recv_fds(sock, SETUP.size + MAX_REGIONS * REGION.size, MAX_REGIONS + 2)
    try:
        while len(data) < SETUP.size:
            data += _more(sock, SETUP.size - len(data))
        ring_bytes, table_bytes, count = SETUP.unpack_from(data)
        want = SETUP.size + count * REGION.size
        while len(data) < want:
            data += _more(sock, want - len(data))
        if len(fds) != count + 2:
            raise ConnectionError(f"the receiver sent {len(fds)} descriptors for {count} regions")
        regions = {}
        for i in range(count):
            region_id, size = REGION.unpack_from(data, SETUP.size + i * REGION.size)
            regions[region_id] = (fds[2 + i], size)
        return (fds[0], ring_bytes), (fds[1], table_bytes), regions
    except BaseException:
        for fd in fds:
            socket.close(fd)
        raise


def _more(sock: socket.socket, num_bytes: int) -> bytes:
    more = sock.recv(num_bytes)
    if not more:
        raise ConnectionError("connection closed during the shared-memory setup")
    return more
