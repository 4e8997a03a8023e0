"""Waiting in tests without sleeping as synchronization: poll a condition under a deadline; a free
loopback port. One copy for every test folder (``pythonpath = ["tests"]``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


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
    """A port the OS considers free now (a small race with other binders is accepted)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
