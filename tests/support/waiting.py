"""Waiting in tests without sleeping as synchronization: poll a condition under a deadline; a free
loopback port. One copy for every test folder (``pythonpath = ["tests"]``)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

# The kernel hands outgoing connections local ports from this range (its low end read per call; the
# usual default when it cannot be read). _LOWEST: the lowest port free_port picks below it.
_LOCAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.01) -> float:
    """Poll until ``condition()`` is true; returns the seconds it took; fails the test (naming
    ``what``) at the deadline."""
    start = time.monotonic()
    deadline = start + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the range the kernel takes outgoing connections' local ports from.

    A port from ``bind(0)`` is in that range: any client connecting anywhere (a heartbeat, an HTTP
    call) may be given it as its local port before the process meant for it binds it, or while a
    restarted process is down (seen: a vLLM-tier router restart failing ``Address already in use``).
    Below the range only another explicit binder can take it (a small race that is accepted). Falls
    back to ``bind(0)`` when the range leaves no room below it."""
    high = _ephemeral_low()
    for _ in range(200):
        if high <= _LOWEST:
            break
        port = random.randrange(_LOWEST, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(_LOCAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # the usual Linux default
