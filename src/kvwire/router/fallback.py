"""P/D fallback (``--pd-fallback colocated``, decision 124): a model with a live decode instance but no
live prefill instance is served by D alone, as a colocated request, rather than refused with a 503.

Each such request is counted (``kvwire_router_pd_fallback_total``); the warning is logged once per
model, then at most once per ``interval_s`` with the count since (a cluster whose P is down would
otherwise log every request).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from kvwire.http.refusal_log import LogThrottle

log = logging.getLogger(__name__)


class FallbackNotice:
    """Counts and warns about requests served by D alone. Event-loop thread only."""

    def __init__(self, counter: Counter, interval_s: float = 60.0) -> None:
        self._counter = counter
        self._throttle = LogThrottle(interval_s)  # per model

    def served_alone(self, model: str | None) -> None:
        self._counter.inc()
        more = self._throttle.due(model)
        if more is None:
            return
        since = f" ({more} more since the last warning)" if more else ""
        log.warning("no live prefill instance for model %r: a decode instance serves the request alone, "
                    "prefill included (--pd-fallback colocated)%s", model, since)
