"""The hello every data link opens with (TCP, shared memory, CUDA IPC; decision 126).

The accepting side sends a nonce; the dialling side answers with its plane's magic and version, the
two epochs (its own instance id and the one its control plane knows for the acceptor) and an HMAC
under the shared secret over all of it. Each plane passes its own magic and version; the layout is
the same for all of them::

    acceptor -> dialler   nonce (NONCE_BYTES random bytes)
    dialler -> acceptor   magic:4s version:u8 src_len:u16 dst_len:u16 src_epoch dst_epoch
                          hmac_sha256(secret, nonce + all of the above)

The MAC is 32 zero bytes when no secret is configured.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Protocol

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.transfer.planes.common.wire import recv_bytes

NONCE_BYTES = 16
MAC_BYTES = 32
MAX_ID_BYTES = 512
HELLO = struct.Struct("!4sBHH")  # magic, version, sender-epoch length, receiver-epoch length


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
