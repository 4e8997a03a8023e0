"""Detects an engine thread that stopped making progress (e.g. a step stuck in a GPU op).

The engine thread stamps ``time.monotonic()`` after every iteration of its loop (a step, or a poll of
its command queue when idle), so an idle engine or long but progressing work keeps the stamp fresh.
The watchdog runs on the event loop: when requests are in flight and the stamp is ``timeout_s`` old,
it declares a stall once (logged at ERROR, counted) and calls ``on_stall`` with an
:class:`~kvwire.errors.EngineStalled` (the engine loop fails the in-flight requests with it: HTTP 503).
The stall lasts until the engine thread stamps again, i.e. until the stuck call returns: then the
watchdog logs the recovery and the server serves again. It never touches the engine itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kvwire.errors import ConfigError, EngineStalled

logger = logging.getLogger(__name__)

_MAX_CHECK_PERIOD_S = 1.0  # detection lags a stall by at most this (or a quarter of the timeout)


class StallWatchdog:
    """One per engine loop. ``check``, ``start`` and the properties run on the event loop's thread;
    ``stop`` may be called from any thread."""

    def __init__(
        self,
        timeout_s: float,
        progress_fn: Callable[[], float],
        busy_fn: Callable[[], bool],
        on_stall: Callable[[EngineStalled], None],
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"engine stall timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._progress_fn = progress_fn  # monotonic time of the engine thread's last iteration
        self._busy_fn = busy_fn  # whether requests are in flight
        self._on_stall = on_stall
        self._stalled_at_progress_s: float | None = None  # the stamp the stall was declared on
        self.num_stalls = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def stalled(self) -> bool:
        return self._stalled_at_progress_s is not None

    def reason(self, now_s: float) -> str:
        """Why the engine counts as stalled (for /health and error bodies)."""
        idle_s = now_s - self._progress_fn()
        return f"the engine stalled: no engine step completed for {idle_s:.1f} s (limit {self.timeout_s:g} s)"

    def check(self, now_s: float) -> bool:
        """Update the state from the engine thread's latest stamp; returns whether it is stalled."""
        progress_s = self._progress_fn()
        if self._stalled_at_progress_s is not None:
            if progress_s <= self._stalled_at_progress_s:
                return True
            # Any stamp after the declaration ends it: the stuck call returned.
            logger.warning("the engine recovered: it completed a step again after %.1f s without one",
                           progress_s - self._stalled_at_progress_s)
            self._stalled_at_progress_s = None
        if now_s - progress_s < self.timeout_s or not self._busy_fn():
            return False
        self._stalled_at_progress_s = progress_s
        self.num_stalls += 1
        error = EngineStalled(self.reason(now_s))
        logger.error("%s with requests in flight; failing them with 503 until it recovers", error)
        self._on_stall(error)
        return True

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Check periodically on ``loop`` (its own thread) until :meth:`stop`."""
        self._task = loop.create_task(self._run(), name="kvwire-engine-stall-watchdog")

    def stop(self) -> None:
        """Stop the periodic checks. Any thread; idempotent."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        loop = task.get_loop()
        with contextlib.suppress(RuntimeError):  # no running loop here / the loop is already closed
            if asyncio.get_running_loop() is loop:
                task.cancel()
                return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(task.cancel)

    async def _run(self) -> None:
        period_s = min(_MAX_CHECK_PERIOD_S, self.timeout_s / 4)
        while True:
            await asyncio.sleep(period_s)  # a check period, not a synchronization
            try:
                self.check(time.monotonic())
            except Exception:  # the watchdog must not die silently
                logger.exception("engine stall check failed")
