"""Wire format and socket helpers of the TCP data plane (see :mod:`kvwire.transfer.planes.tcp.plane`)."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Protocol

import torch

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.transfer.planes.liveness import Heartbeat

MAGIC = b"KVWD"
VERSION = 3  # 2: heartbeats both ways (PING_FRAME, RECEIVER_PING); 3: the hello names both epochs
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_ID_BYTES = 512
HELLO = struct.Struct("!4sBHH")  # magic, version, sender-epoch length, receiver-epoch length
FRAME = struct.Struct("!IQH")  # layer index, payload bytes, transfer-id length
POLL_S = 0.2  # how often idle threads check for close / a dead peer
DISCARD_CHUNK = 1 << 20
CANCEL_MEMORY_S = 120.0
IOV_BATCH = 512  # iovecs per sendmsg/recvmsg_into (Linux IOV_MAX is 1024)
CANCEL_WAIT_S = 1.0  # cancel waits this long for a frame being written into caller memory
PING_LAYER = 0xFFFFFFFF  # a frame with this layer, no payload and no transfer id: the sender's heartbeat
PING_FRAME = FRAME.pack(PING_LAYER, 0, 0)
RECEIVER_PING = b"\x00"  # receiver -> sender after the hello: any byte is a heartbeat


class LinkRefused(ProtocolError):
    """A data link's hello proved the secret but names an epoch this side's control plane does not
    know now (a restarted or forged process), or an earlier epoch of this side (decision 126)."""


class PeerEpochs(Protocol):
    """What a hello is checked against: the agent's control plane (``PlaneCallbacks``)."""

    def peer_endpoint(self, peer_instance_id: str) -> str | None: ...


def hello_mac(secret: bytes | None, nonce: bytes, header: bytes, ids: bytes) -> bytes:
    if secret is None:
        return bytes(MAC_BYTES)
    return hmac.new(secret, nonce + header + ids, hashlib.sha256).digest()


def prove_hello(
    sock: socket.socket, secret: bytes | None, instance_id: str, peer_id: str, magic: bytes, version: int
) -> None:
    """Dialling side of a data link's handshake: answer the acceptor's nonce with our hello (magic,
    version, our epoch ``instance_id``, the epoch ``peer_id`` our control plane knows for the
    acceptor) and its MAC under the shared secret, over all of it."""
    nonce = recv_bytes(sock, NONCE_BYTES)
    me, you = instance_id.encode(), peer_id.encode()
    header = HELLO.pack(magic, version, len(me), len(you))
    sock.sendall(header + me + you + hello_mac(secret, nonce, header, me + you))


def check_hello(
    conn: socket.socket, secret: bytes | None, magic: bytes, version: int, what: str
) -> tuple[str, str]:
    """Accepting side: send a nonce, read the peer's hello, check it and its MAC; the epochs it
    names (the peer's, and the one it believes this side has). ``what`` names the link in errors
    (ProtocolError: not our protocol or version; AuthenticationError: the shared secret was not
    proven). :func:`bind_hello` then checks the epochs against the control plane."""
    nonce = os.urandom(NONCE_BYTES)
    conn.sendall(nonce)
    header = recv_bytes(conn, HELLO.size)
    got_magic, got_version, src_len, dst_len = HELLO.unpack(header)
    if got_magic != magic or got_version != version:
        raise ProtocolError(f"bad {what} hello (magic {got_magic!r}, version {got_version}; want {version})")
    if not (0 < src_len <= MAX_ID_BYTES and 0 < dst_len <= MAX_ID_BYTES):
        raise ProtocolError(f"bad {what} hello (epochs of {src_len} and {dst_len} bytes)")
    ids = recv_bytes(conn, src_len + dst_len)
    if not hmac.compare_digest(recv_bytes(conn, MAC_BYTES), hello_mac(secret, nonce, header, ids)):
        raise AuthenticationError(f"{what} could not prove the shared secret")
    return ids[:src_len].decode(errors="replace"), ids[src_len:].decode(errors="replace")


def bind_hello(claim: tuple[str, str], instance_id: str, control: PeerEpochs, what: str) -> str:
    """The peer epoch of an authenticated hello, once bound to the control plane: it must name this
    process's epoch ``instance_id`` and an epoch the control plane authenticated and still holds
    for its endpoint; LinkRefused otherwise (decision 126)."""
    peer_id, mine = claim
    if mine != instance_id:
        raise LinkRefused(
            f"{what} from {peer_id!r} was meant for epoch {mine!r}, this process is {instance_id!r}"
            " (a sender that knew an earlier process here)"
        )
    if control.peer_endpoint(peer_id) is None:
        raise LinkRefused(
            f"{what} claims epoch {peer_id!r}, which the control plane does not know now"
            " (a restarted, forgotten or forged process)"
        )
    return peer_id


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
