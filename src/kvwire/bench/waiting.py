"""Waiting for one transfer's end in a benchmark: asleep in ``TransferAgent.wait`` between polls.

A loop of short sleeps costs a core in wake-ups (100-150 us of CPU each on a VM), the core the
planes' own threads need on a small box; an engine with nothing else to do would sleep too.
"""

from __future__ import annotations

import time
from typing import Any

#: what ``field`` of the agent's events to wait for
SENT = "finished_sending"
RECEIVED = "finished_recving"


def wait_transfer(agent: Any, transfer_id: str, field: str, timeout_s: float = 120.0) -> None:
    """Until ``transfer_id`` shows in ``field`` of ``agent``'s events (other transfers' events are
    dropped: a benchmark runs one at a time). Raises RuntimeError if it fails, TimeoutError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        ev = agent.poll()
        if transfer_id in ev.failed:
            raise RuntimeError(f"transfer {transfer_id} failed: {ev.failed[transfer_id]}")
        if transfer_id in getattr(ev, field):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"transfer {transfer_id} not {field.split('_')[1]} within {timeout_s:.0f} s")
        agent.wait(min(left, 1.0))
