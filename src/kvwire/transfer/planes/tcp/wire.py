"""Wire format and socket helpers of the TCP data plane (see :mod:`kvwire.transfer.planes.tcp.plane`)."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import torch

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.transfer.planes.liveness import Heartbeat

MAGIC = b"KVWD"
VERSION = 2  # 2: heartbeats both ways (PING_FRAME, RECEIVER_PING)
NONCE_BYTES = 16
MAC_BYTES = 32
HELLO = struct.Struct("!4sBH")  # magic, version, instance-id length
FRAME = struct.Struct("!IQH")  # layer index, payload bytes, transfer-id length
POLL_S = 0.2  # how often idle threads check for close / a dead peer
DISCARD_CHUNK = 1 << 20
CANCEL_MEMORY_S = 120.0
IOV_BATCH = 512  # iovecs per sendmsg/recvmsg_into (Linux IOV_MAX is 1024)
CANCEL_WAIT_S = 1.0  # cancel waits this long for a frame being written into caller memory
PING_LAYER = 0xFFFFFFFF  # a frame with this layer, no payload and no transfer id: the sender's heartbeat
PING_FRAME = FRAME.pack(PING_LAYER, 0, 0)
RECEIVER_PING = b"\x00"  # receiver -> sender after the hello: any byte is a heartbeat


def hello_mac(secret: bytes | None, nonce: bytes, instance_id: bytes) -> bytes:
    if secret is None:
        return bytes(MAC_BYTES)
    return hmac.new(secret, nonce + instance_id, hashlib.sha256).digest()


def prove_hello(
    sock: socket.socket, secret: bytes | None, instance_id: str, magic: bytes, version: int
) -> None:
    """Dialling side of a data link's handshake: answer the acceptor's nonce with our hello (magic,
    version, instance id) and its MAC under the shared secret."""
    nonce = recv_bytes(sock, NONCE_BYTES)
    me = instance_id.encode()
    sock.sendall(HELLO.pack(magic, version, len(me)) + me + hello_mac(secret, nonce, me))


def check_hello(conn: socket.socket, secret: bytes | None, magic: bytes, version: int, what: str) -> str:
    """Accepting side: send a nonce, read the peer's hello, check it and its MAC; the peer's instance
    id. ``what`` names the link in errors (ProtocolError: not our protocol or version;
    AuthenticationError: the shared secret was not proven)."""
    nonce = os.urandom(NONCE_BYTES)
    conn.sendall(nonce)
    got_magic, got_version, id_len = HELLO.unpack(recv_bytes(conn, HELLO.size))
    if got_magic != magic or got_version != version or not 0 < id_len <= 512:
        raise ProtocolError(f"bad {what} hello (magic {got_magic!r}, version {got_version})")
    peer_id = recv_bytes(conn, id_len)
    if not hmac.compare_digest(recv_bytes(conn, MAC_BYTES), hello_mac(secret, nonce, peer_id)):
        raise AuthenticationError(f"{what} could not prove the shared secret")
    return peer_id.decode(errors="replace")


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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


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


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
