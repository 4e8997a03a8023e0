"""Raw-socket HTTP clients for write-deadline tests (server and router)."""

from __future__ import annotations

import socket
import time


def read_slowly(sock: socket.socket, pause_s: float, every_bytes: int) -> tuple[bytes, bytes]:
    """Read one HTTP response (Content-Length framed) from ``sock``, pausing ``pause_s`` after each
    ``every_bytes``; returns (head, body). Blocking: run it off the event loop (a bytearray, so the
    reader does not hog the GIL copying)."""
    data, since_pause = bytearray(), 0
    head_end, length = -1, None
    while length is None or len(data) < head_end + 4 + length:
        piece = sock.recv(65536)
        assert piece, f"connection closed after {len(data)} bytes"
        data += piece
        since_pause += len(piece)
        if since_pause >= every_bytes:
            time.sleep(pause_s)  # the slow reader under test, not a synchronization
            since_pause = 0
        if length is None and (head_end := data.find(b"\r\n\r\n")) >= 0:
            fields = dict(line.split(b": ", 1) for line in bytes(data[:head_end]).split(b"\r\n")[1:])
            length = int(fields[b"Content-Length"])
    return bytes(data[:head_end]), bytes(data[head_end + 4 :])
