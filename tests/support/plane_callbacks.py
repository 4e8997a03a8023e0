"""A data plane's agent for plane tests: records what a plane reports through ``PlaneCallbacks``.

``log`` keeps every report in order (``("sent" | "received", transfer_id, layers)``,
``("failed", transfer_id, reason)``, ``("peer_failed", peer, reason)``, ``("protocol_error", reason)``);
the per-kind lists keep one entry per layer or event. ``on_received`` raises ``fail_first`` times first
(a sink that raises). Every epoch is known: ``peer_endpoint`` names one for any peer (the binding has
tests of its own: ``tests/unit/transfer/test_link_binding.py``). Thread-safe: planes report from their
own threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class RecordingCallbacks:
    def __init__(self, fail_first: int = 0) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, Any]] = []
        self.received: list[tuple[str, int]] = []  # (transfer id, layer)
        self.sent: list[tuple[str, int]] = []
        self.transfer_failed: list[tuple[str, str]] = []  # (transfer id, reason)
        self.peer_failed: list[tuple[str, str]] = []  # (peer, reason)
        self.protocol_errors: list[str] = []
        self.fail_first = fail_first

    def on_sent(self, peer: str, transfer_id: str, layers: Sequence[int]) -> None:
        with self.lock:
            self.log.append(("sent", transfer_id, list(layers)))
            self.sent += [(transfer_id, i) for i in layers]

    def on_received(self, peer: str, transfer_id: str, layers: Sequence[int]) -> None:
        with self.lock:
            if self.fail_first > 0:
                self.fail_first -= 1
                raise RuntimeError("a sink that raises")
            self.log.append(("received", transfer_id, list(layers)))
            self.received += [(transfer_id, i) for i in layers]

    def on_transfer_failed(self, transfer_id: str, reason: str) -> None:
        with self.lock:
            self.log.append(("failed", transfer_id, reason))
            self.transfer_failed.append((transfer_id, reason))

    def on_peer_failed(self, peer: str, reason: str) -> None:
        with self.lock:
            self.log.append(("peer_failed", peer, reason))
            self.peer_failed.append((peer, reason))

    def on_protocol_error(self, reason: str) -> None:
        with self.lock:
            self.log.append(("protocol_error", "", reason))
            self.protocol_errors.append(reason)

    def peer_endpoint(self, peer_instance_id: str) -> str | None:
        return f"tcp://{peer_instance_id}"

    def on_device_copy(self, num_bytes: int, seconds: float) -> None:
        pass
