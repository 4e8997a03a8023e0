"""Liveness of an authenticated data link: kernel keepalive, heartbeats, and the deadline of a link
that moves nothing (docs/decisions/115-data-link-bounds.md).

Three failures, three mechanisms:

* **the peer stops reading** (frozen, stuck, or a partition with buffers full): every write on a
  data link runs under the socket's timeout, ``link_timeout_s``. ``sendmsg`` on a socket with a
  timeout waits at most that long for room, per call, so a write fails after that long without
  progress (not after that long in total: a slow link that keeps moving is not cut);
* **the peer's host vanishes** (power, kernel, cable): TCP keepalive with short probes
  (``TCP_KEEPIDLE``/``TCP_KEEPINTVL`` = ``keepalive_s``, ``TCP_KEEPCNT`` so the probes span
  ``link_timeout_s``) and ``TCP_USER_TIMEOUT`` = ``link_timeout_s`` (unacknowledged data, where
  keepalive does not probe) make the kernel fail the socket;
* **a partition the kernel cannot see** (a userspace proxy or relay that holds the bytes, a peer
  process that is alive but never writes again): both ends of a TCP link send a heartbeat every
  ``keepalive_s`` while idle (:class:`Heartbeat`), and an end that hears nothing for
  ``link_timeout_s`` cuts the link. Kernel keepalive is answered by the proxy's kernel, so only a
  heartbeat of our own sees this one.

On the same-host links (shared memory, CUDA IPC) a peer that dies closes its descriptors, so the
reader sees EOF at once; only the write deadline is needed there.
"""

from __future__ import annotations

import math
import socket
import time

from kvwire.supervision import HealthBoard
from kvwire.transfer.planes.common.link_config import DataLinkConfig

LINK_TIMEOUT = "data_link_timeout"  # kvwire_limit_hits_total{limit}: a link cut for moving nothing


def tcp_keepalive(sock: socket.socket, links: DataLinkConfig) -> None:
    """Short kernel keepalive probes and a bound on unacknowledged data (Linux options where known)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    interval_s = max(1, round(links.keepalive_s))  # the kernel counts whole seconds
    options = (
        ("TCP_KEEPIDLE", interval_s),
        ("TCP_KEEPINTVL", interval_s),
        ("TCP_KEEPCNT", max(1, math.ceil(links.link_timeout_s / interval_s))),
        ("TCP_USER_TIMEOUT", round(links.link_timeout_s * 1000)),  # milliseconds
    )
    for name, value in options:
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class Heartbeat:
    """One end's view of a TCP link's liveness. Used by the one thread that reads (and pings on) the
    socket: not thread-safe.

    ``heard()`` after every read that returned bytes, ``idle()`` when a read timed out or the writer
    had nothing to write: ``idle`` raises :class:`TimeoutError` when nothing was heard for
    ``link_timeout_s``; both send ``ping`` when nothing was sent for ``keepalive_s``. The end that
    writes frames calls ``sent()`` after each (its data is its heartbeat)."""

    def __init__(self, sock: socket.socket, links: DataLinkConfig, ping: bytes, what: str) -> None:
        self.sock = sock
        self.keepalive_s = links.keepalive_s
        self.timeout_s = links.link_timeout_s
        self._ping = ping
        self.what = what
        now = time.monotonic()
        self.last_heard = now
        self.last_sent = now

    def heard(self) -> None:
        """Bytes arrived; sends the heartbeat if one is due (also while a long frame streams in:
        the other end may be idle already, its last bytes still in the buffers on the way)."""
        now = self.last_heard = time.monotonic()
        if now - self.last_sent >= self.keepalive_s:
            self.sock.sendall(self._ping)
            self.last_sent = now

    def sent(self) -> None:
        self.last_sent = time.monotonic()

    def ping_if_due(self) -> None:
        if time.monotonic() - self.last_sent >= self.keepalive_s:
            self.sock.sendall(self._ping)
            self.sent()

    def idle(self) -> None:
        silent_s = time.monotonic() - self.last_heard
        if silent_s > self.timeout_s:
            raise TimeoutError(f"{self.what}: nothing heard from the peer for {silent_s:.1f} s "
                               f"(link timeout {self.timeout_s:g} s)")
        self.ping_if_due()


def count_cut(board: HealthBoard, error: BaseException | None) -> None:
    """Count a link that ended on a deadline (a write without progress, silence, no credit)."""
    if isinstance(error, TimeoutError):
        board.limit_hit(LINK_TIMEOUT)
