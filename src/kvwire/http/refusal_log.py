"""Log refused requests without letting a client flood the log: once per reason, then a summary."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable


class LogThrottle:
    """Once per key, then at most once per ``interval_s``: :meth:`due` says whether to log now and how
    many were held back since the last time (any thread)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def due(self, key: Hashable) -> int | None:
        """None: held back (counted); else log now, with this many held back since the last time."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._suppressed.pop(key, 0)


class RefusalLog:
    """Logs refusals once per reason, then at most one summary line per ``interval_s`` (any thread)."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._what = what
        self._throttle = LogThrottle(interval_s)

    def refused(self, reason: str, detail: str) -> None:
        suppressed = self._throttle.due(reason)
        if suppressed is None:
            return
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        self._logger.warning("refused %s (%s): %s%s", self._what, reason, detail, more)
