"""Log refused requests without letting a client flood the log: once per reason, then a summary."""

from __future__ import annotations

import logging
import threading
import time


class RefusalLog:
    """Logs refusals once per reason, then at most one summary line per ``interval_s`` (any thread)."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._what = what
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def refused(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < self._interval_s:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return
            self._last[reason] = now
            suppressed = self._suppressed.pop(reason, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        self._logger.warning("refused %s (%s): %s%s", self._what, reason, detail, more)
