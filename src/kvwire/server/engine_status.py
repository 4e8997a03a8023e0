"""What the engine loop reports about the engine: a stats snapshot and its health.

Immutable values, safe to read on any thread (``/health``, ``/metrics``, the heartbeat thread); the
engine loop (:mod:`kvwire.server.engine_loop`) produces them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class EngineHealth(enum.Enum):
    """What ``/health`` reports about the engine (the value is its ``status`` string)."""

    OK = "ok"
    STALLED = "engine stalled"  # no progress for the stall timeout; clears when the engine resumes
    STOPPED = "engine thread stopped"  # for good


@dataclasses.dataclass(frozen=True)
class EngineStatus:
    """The engine loop's health, for ``/health`` and ``/metrics``."""

    health: EngineHealth = EngineHealth.OK
    reason: str = ""  # why it is not OK
    num_stalls: int = 0  # stalls declared since start (each one failed the requests then in flight)


@dataclasses.dataclass(frozen=True)
class StatsSnapshot:
    """Engine statistics copied on the engine thread after each iteration (safe to read anywhere)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_remote_kv: int = 0
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0

    @classmethod
    def of(cls, stats: Any) -> StatsSnapshot:
        fields = {f.name: int(getattr(stats, f.name, 0) or 0) for f in dataclasses.fields(cls)}
        return cls(**fields)
