"""What the engine loop reports about the engine: a stats snapshot and its health.

Immutable values, safe to read on any thread (``/health``, ``/metrics``, the heartbeat thread); the
engine loop (:mod:`kvwire.server.engine_loop`) produces them.
"""

from __future__ import annotations

import dataclasses
import enum
import time
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
    num_prefix_cache_hit_tokens: int = 0  # prompt tokens found in the local prefix cache, since start
    # time.monotonic() when copied: the loop refreshes the snapshot between engine steps, so during a
    # long step it lags the live connector/transfer metrics (exported as its age)
    taken_at: float = dataclasses.field(default_factory=time.monotonic)

    @classmethod
    def of(cls, stats: Any) -> StatsSnapshot:
        counts = [f.name for f in dataclasses.fields(cls) if f.name != "taken_at"]
        return cls(**{name: int(getattr(stats, name, 0) or 0) for name in counts})

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the snapshot was copied."""
        return max(0.0, (time.monotonic() if now is None else now) - self.taken_at)
