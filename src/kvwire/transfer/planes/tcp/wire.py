"""Wire format and socket helpers of the TCP data plane (see :mod:`kvwire.transfer.planes.tcp.plane`).
The hello and the socket reads and writes every link shares live in
:mod:`kvwire.transfer.planes.common`."""

from __future__ import annotations

import socket
import struct

import torch

MAGIC = b"KVWD"
VERSION = 3  # 2: heartbeats both ways (PING_FRAME, RECEIVER_PING); 3: the hello names both epochs
FRAME = struct.Struct("!IQH")  # layer index, payload bytes, transfer-id length
DISCARD_CHUNK = 1 << 20
PING_LAYER = 0xFFFFFFFF  # a frame with this layer, no payload and no transfer id: the sender's heartbeat
PING_FRAME = FRAME.pack(PING_LAYER, 0, 0)
RECEIVER_PING = b"\x00"  # receiver -> sender after the hello: any byte is a heartbeat


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def host_port(address: str) -> tuple[str, int]:
    """A peer's ``host:port`` data address (from its plane_info: the peer's choice). One that is not
    raises ConnectionError, which the writer reports as the link failing (it raised ValueError or
    OverflowError, which ended the writer thread as an error)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectionError(f"{address[:80]!r} is not a host:port data address")
    return host.strip("[]"), int(port)
