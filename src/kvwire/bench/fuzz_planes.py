"""Fuzz targets of the data planes' stream parsers (see :mod:`kvwire.bench.fuzz_targets`).

A data link is a byte stream, so each input is written into one end of a ``socketpair`` (then shut
for writing; the shared-memory reader gets the bytes from a stand-in with the socket's ``recv`` and
``sendall``) and the plane's own reading code runs on the other end until the stream ends: the TCP
and shared-memory hellos (``check_hello``) and the frame readers of an established link
(``TcpPlane._read_frame``, the shared-memory ``Inbound._read_chunk``) with one layer posted, as on a
receiver waiting for a transfer. ``allowed`` is what each plane's reader loop catches and turns into a
refused or failed link; anything else would end the reader thread unannounced. No thread is started:
the parsers run on the calling thread, against a plane that was constructed but not started.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from kvwire.bench import fuzz_corpus
from kvwire.bench.fuzz_targets import FuzzTarget
from kvwire.errors import ProtocolError

_PEER = "b" * 32
_LAYER_BYTES = 64
_READ_LIMIT = 10_000  # frames read from one input at most (each input is a few KiB: never reached)


class _Callbacks:
    """A plane's reports, counted (the agent's role; nothing to assert on)."""

    def __init__(self) -> None:
        self.calls = 0

    def _count(self, *_: object) -> None:
        self.calls += 1

    on_sent = on_received = on_transfer_failed = on_peer_failed = on_protocol_error = on_device_copy = _count

    def peer_endpoint(self, peer_instance_id: str) -> str | None:
        return f"tcp://fuzz/{peer_instance_id}"  # every epoch known: the inputs reach the frame readers


def _stream(data: bytes, read: Callable[[socket.socket], object]) -> object:
    """Write ``data`` into a fresh socket pair, close that end for writing, ``read`` the other end."""
    ours, theirs = socket.socketpair()
    try:
        theirs.settimeout(5.0)  # what the planes' handshakes do; a complete input never waits
        ours.sendall(data)
        ours.shutdown(socket.SHUT_WR)
        return read(theirs)
    finally:
        ours.close()
        theirs.close()


class _Link:
    """The shared-memory reader's side of a link (``recv``, ``sendall``) over one input: the frames
    come from ``data``, the credits it writes back are dropped (a real socket pair would fill up
    with credits nobody reads)."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self.credits = 0

    def recv(self, num_bytes: int) -> bytes:
        out, self._data = bytes(self._data[:num_bytes]), self._data[num_bytes:]
        return out

    def sendall(self, data: bytes) -> None:
        self.credits += 1


def tcp_hello() -> FuzzTarget:
    """The accepting side of a TCP (and, same code, shared-memory and IPC) link's handshake."""
    from kvwire.transfer.planes.common.hello import check_hello
    from kvwire.transfer.planes.tcp.wire import MAGIC, VERSION

    def check(data: bytes) -> object:
        return _stream(data, lambda conn: check_hello(conn, None, MAGIC, VERSION, "data connection"))

    return FuzzTarget("plane.tcp_hello", check, (ProtocolError, OSError), fuzz_corpus.tcp_hellos)


def _until_end(read_one: Callable[[], object]) -> int:
    """Read frames until the stream ends (the peer closed: the reader's ConnectionError, the normal
    end of an input here); how many completed a layer. Other errors propagate."""
    landed = 0
    for _ in range(_READ_LIMIT):
        try:
            landed += read_one() is not None
        except ConnectionError:
            break
    return landed


def tcp_frames() -> FuzzTarget:
    """Frames on an authenticated TCP link, with layer 0 of ``req-1`` posted by this peer."""
    import torch

    from kvwire.transfer.config import TransferConfig
    from kvwire.transfer.memory import RecvItem
    from kvwire.transfer.planes.common.liveness import Heartbeat
    from kvwire.transfer.planes.tcp.plane import TcpPlane
    from kvwire.transfer.planes.tcp.recv import TcpInbound
    from kvwire.transfer.planes.tcp.wire import RECEIVER_PING

    plane = TcpPlane(TransferConfig(), "a" * 32)
    plane.callbacks = _Callbacks()
    dest = torch.zeros(_LAYER_BYTES, dtype=torch.uint8)

    def read(conn: socket.socket) -> int:
        inbound = TcpInbound(plane, conn)
        inbound.peer_id = _PEER
        beat = Heartbeat(conn, plane.config.links, RECEIVER_PING, "tcp data link")
        return _until_end(lambda: inbound._read_frame(beat))

    def check(data: bytes) -> object:
        with plane.lock:
            plane.posted.clear()
            plane.posted[("req-1", 0)] = (_PEER, RecvItem("req-1", 0, _LAYER_BYTES, dest))
            plane.cancelled.clear()
        return _stream(data, read)

    return FuzzTarget("plane.tcp_frames", check, (ProtocolError, OSError), fuzz_corpus.tcp_frames)


def shm_frames() -> FuzzTarget:
    """Frames on an authenticated shared-memory link (ring chunks, one-copy DONE), layers 0 and 1
    of ``req-1`` posted by this peer."""
    import torch

    from kvwire.transfer.config import MiB, TransferConfig
    from kvwire.transfer.memory import RecvItem
    from kvwire.transfer.planes.shm.plane import Inbound, ShmPlane
    from kvwire.transfer.planes.shm.send import create_ring, ring_array

    config = TransferConfig(recv_budget_bytes=1 * MiB, shm_ring_bytes=1 * MiB)
    plane = ShmPlane(config, "a" * 32)
    plane.callbacks = _Callbacks()
    fd, mapping = create_ring(config.shm_ring_bytes)
    os.close(fd)
    ring = ring_array(mapping)  # keeps the mapping alive as long as the target
    dests = [torch.zeros(_LAYER_BYTES, dtype=torch.uint8) for _ in range(2)]

    def read(data: bytes) -> int:
        link = Inbound(plane, _Link(data))  # type: ignore[arg-type]
        link.peer_id = _PEER
        return _until_end(lambda: link._read_chunk(ring))

    def check(data: bytes) -> object:
        with plane.lock:
            plane.posted = {
                ("req-1", i): (_PEER, RecvItem("req-1", i, _LAYER_BYTES, d)) for i, d in enumerate(dests)
            }
            plane.landing.clear()
            plane.cancelled.clear()
        return read(data)

    return FuzzTarget("plane.shm_frames", check, (ProtocolError, OSError, ValueError), fuzz_corpus.shm_frames)
