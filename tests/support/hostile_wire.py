"""Hostile bytes for every port a cluster opens (tests/faults/test_hostile_ports.py).

:func:`listening` finds a process's listening ends from /proc (TCP ports, abstract Unix sockets): the
data planes are advertised only inside the control protocol, so /proc is how a test on the same host
finds every port, the ones nobody lists included. The corpora are built from the fuzzing tier's seeds
(real messages from the real encoders, :mod:`kvwire.bench.fuzz_corpus`) and its structure-aware
mutator, plus the classics: a nesting bomb, oversize, truncation, garbage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Iterator

import msgspec
import zmq

from kvwire.bench import fuzz_corpus, fuzz_mutate
from kvwire.errors import ProtocolError
from kvwire.transfer.planes.common.hello import HELLO, MAC_BYTES, NONCE_BYTES
from kvwire.transfer.planes.shm.wire import MAGIC as SHM_MAGIC
from kvwire.transfer.planes.shm.wire import VERSION as SHM_VERSION
from kvwire.transfer.planes.tcp.wire import MAGIC as TCP_MAGIC
from kvwire.transfer.planes.tcp.wire import VERSION as TCP_VERSION
from kvwire.transfer.wire import Codec

NEST = b"\x91" * 60_000 + b"\x90"  # the 60 KB frame of issue 33
OVERSIZE = 16 << 20  # bytes: far past every decoder's cap (64 KiB discovery, 4 MiB control)
SOCKET_TIMEOUT_S = 10.0
_LISTEN = "0A"  # /proc/net/tcp state
_SO_ACCEPTCON = 0x10000  # /proc/net/unix flags: a listening socket


@dataclasses.dataclass(frozen=True)
class Listening:
    tcp_ports: frozenset[int]
    unix_names: frozenset[str]  # abstract names as /proc shows them ("@kvwire-shm-...")


def listening(pid: int) -> Listening:
    """The TCP ports and abstract Unix sockets ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}", encoding="ascii") as rows:
            for row in list(rows)[1:]:
                cols = row.split()
                if cols[9] in inodes and cols[3] == _LISTEN:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    names = set()
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as rows:
        for row in list(rows)[1:]:
            cols = row.split()
            if len(cols) >= 8 and cols[6] in inodes and int(cols[3], 16) & _SO_ACCEPTCON:
                names.add(cols[7])
    return Listening(frozenset(ports), frozenset(names))


# --- ZeroMQ ports (the router's discovery PULL, each instance's control ROUTER) ---------------------


def zmq_corpus(seeds: list[bytes], selector: bool) -> list[list[bytes]]:
    """Multipart messages: the seeds (their target's selector byte dropped) mutated, truncated, a
    nesting bomb, an oversized frame, empty and extra frames."""
    plain = [s[1:] if selector else s for s in seeds]
    mutants = fuzz_mutate.inputs(plain, 300, seed=33, max_len=8192)
    cases = [[m] for m in mutants] + [[s[: len(s) // 2]] for s in plain]
    cases += [[NEST], [NEST, b""], [bytes(OVERSIZE)], [b""], [plain[0], b"x" * 32, b"extra"], [b"\xc1" * 100]]
    return cases


def send_zmq(endpoint: str, kind: int, cases: list[list[bytes]]) -> None:
    """Send every case from one socket of ``kind`` (PUSH to a PULL, DEALER to a ROUTER); returns
    once ZeroMQ has written them (linger)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 30_000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(endpoint)
        for frames in cases:
            sock.send_multipart(frames)
        sock.close()  # waits up to the linger for the queue to drain
    finally:
        ctx.term()


def discovery_cases() -> list[list[bytes]]:
    return zmq_corpus(fuzz_corpus.discovery_frames(), selector=True)


def control_cases(peer_endpoint: str) -> list[list[bytes]]:
    """Control-port cases. A mutant that still decodes is a well-formed message from a "peer": it
    is kept only when it names ``peer_endpoint`` (a real peer's, to which the instance already has a
    socket) as its reply endpoint; another would open one more cached socket to that endpoint,
    which is the (bounded) cache of peers, not a leak."""
    codec = Codec(None)
    seeds = [codec.encode(msgspec.structs.replace(codec.decode([s[1:]]), src_endpoint=peer_endpoint))[0]
             for s in fuzz_corpus.control_messages() if s[0] == 0]
    kept = []
    for frames in zmq_corpus(seeds, selector=False):
        try:
            msg = codec.decode(frames[:2])
        except ProtocolError:
            kept.append(frames)
            continue
        if msg.src_endpoint == peer_endpoint:
            kept.append(frames)
    return kept


# --- raw streams (any TCP port, data planes over TCP and abstract Unix sockets) ---------------------


def connect(address: int | str) -> socket.socket:
    """A TCP connection to 127.0.0.1:``address`` (int) or to the abstract Unix socket ``@name``."""
    if isinstance(address, int):
        return socket.create_connection(("127.0.0.1", address), timeout=SOCKET_TIMEOUT_S)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(SOCKET_TIMEOUT_S)
    sock.connect("\0" + address.removeprefix("@"))
    return sock


def send_and_close(address: int | str, payload: bytes) -> None:
    """Connect, write ``payload`` (as much as the peer takes), close."""
    with contextlib.suppress(OSError), connect(address) as sock:
        sock.sendall(payload)


def garbage_streams() -> list[bytes]:
    """What any stream port gets: nothing, garbage, an HTTP request, a TLS hello, a nesting bomb."""
    tls_hello = bytes.fromhex("160301002a0100002603035a") + bytes(32)
    return [b"", os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", tls_hello, NEST[:8192],
            b"\xff" * 65536]


def _stream_drain(sock: socket.socket) -> list[int]:
    """Read what the peer sends until it closes or goes quiet; close every descriptor it passed."""
    fds: list[int] = []
    sock.settimeout(1.0)
    with contextlib.suppress(OSError):
        while True:
            data, got, _, _ = socket.recv_fds(sock, 65536, 300)
            fds.extend(got)
            if not data:
                break
    for fd in fds:
        os.close(fd)
    return fds


def data_plane_session(address: int | str, frames: bytes) -> None:
    """A peer that proves the hello's MAC (no secret: all zeros) and then sends ``frames``; the
    target refuses it at the binding (decision 126), so the frames test that nothing follows a refusal.
    Descriptors the shared-memory plane passes at setup are closed here (the test's, not a leak)."""
    magic, version = (TCP_MAGIC, TCP_VERSION) if isinstance(address, int) else (SHM_MAGIC, SHM_VERSION)
    me = b"hostile-peer"
    with contextlib.suppress(OSError), connect(address) as sock:
        nonce = b""
        while len(nonce) < NONCE_BYTES:
            more = sock.recv(NONCE_BYTES - len(nonce))
            if not more:
                return
            nonce += more
        # the epochs of no agent the target knows: the hello is refused at the binding (decision 126)
        sock.sendall(HELLO.pack(magic, version, len(me), len(me)) + me + me + bytes(MAC_BYTES))
        sock.sendall(frames)  # the shared-memory setup (with descriptors) is read by the drain
        sock.shutdown(socket.SHUT_WR)
        _stream_drain(sock)


def data_plane_cases(shm: bool) -> list[bytes]:
    """Frame streams after the hello: the planes' seed frames (nobody posted those layers: each is
    unsolicited) mutated, a length field of 2**64-1, truncations."""
    seeds = fuzz_corpus.shm_frames() if shm else fuzz_corpus.tcp_frames()
    cases = fuzz_mutate.inputs(seeds, 40, seed=7, max_len=4096)
    return [*cases, *(s[: len(s) // 2] for s in seeds), b"\xff" * 64]


def hello_cases(shm: bool) -> list[bytes]:
    """Bad hellos: wrong magic, wrong version, an id of 0 or 65535 bytes, truncated, a bad MAC."""
    magic, version = (SHM_MAGIC, SHM_VERSION) if shm else (TCP_MAGIC, TCP_VERSION)
    ids = b"abcdefgh"
    return [HELLO.pack(b"NOPE", version, 4, 4) + ids + bytes(32), HELLO.pack(magic, 99, 4, 4) + ids,
            HELLO.pack(magic, version, 0, 4), HELLO.pack(magic, version, 65535, 4) + b"x" * 100,
            HELLO.pack(magic, version, 4, 4)[:5], HELLO.pack(magic, version, 4, 4) + ids + b"\x01" * 32]


def hello_session(address: int | str, hello: bytes) -> None:
    """Read the acceptor's nonce, send ``hello``, close."""
    with contextlib.suppress(OSError), connect(address) as sock:
        sock.recv(NONCE_BYTES)
        sock.sendall(hello)
        sock.shutdown(socket.SHUT_WR)
        _stream_drain(sock)


# --- HTTP --------------------------------------------------------------------------------------------


def http_raw_cases() -> list[bytes]:
    """Whole requests, written raw: nested and huge JSON, bad unicode, a huge header, lying lengths."""
    def post(body: bytes, extra: bytes = b"") -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
                + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    nested = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    return [
        post(nested), post(b'{"prompt": "' + b"\xff\xfe\xed\xa0\x80" * 100 + b'"}'),
        post(b'{"prompt": "\\ud800", "max_tokens": 1e999}'),
        post(b'{"prompt": [1], "kv_transfer_params": {"transfer_id": "' + b"x" * 100_000 + b'"}}'),
        post(b"{}", b"X-Big: " + b"a" * 200_000 + b"\r\n"),
        post(b"{}", b"".join(b"X-H%d: v\r\n" % i for i in range(2000))),
        post(b'{"prompt": [1]}')[:-5],  # the body stops short of its Content-Length
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n{",
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x00\xff" + os.urandom(300),
    ]


SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: "


@contextlib.contextmanager
def held_open(
    addresses: list[int | str], per_address: int, head: bytes = b""
) -> Iterator[list[socket.socket]]:
    """``per_address`` connections to each address, each having sent ``head`` (nothing: half-open,
    a slow sender's first bytes: slow loris), held until the block ends."""
    socks: list[socket.socket] = []
    try:
        for address in addresses:
            for _ in range(per_address):
                with contextlib.suppress(OSError):
                    sock = connect(address)
                    socks.append(sock)
                    if head:
                        sock.sendall(head)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """The peer closed (EOF or reset) within ``timeout_s``; whatever it sent before is read away."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 300)
        except TimeoutError:
            continue
        except OSError:
            return True
        for fd in fds:
            os.close(fd)
        if not data:
            return True
    return False
