"""The registry's sweeper: the thread that expires silent instances (:meth:`Registry.sweep`)."""

from __future__ import annotations

import threading

from kvwire.router.registry import Registry
from kvwire.supervision import HealthBoard, SupervisedThread

_MIN_SWEEP_WAIT_S = 0.005  # the sweeper never spins faster than this
_SWEEP_MARGIN_S = 0.002  # wake just past a deadline, so the entry is past its TTL


class RegistrySweeper:
    """Daemon thread calling ``registry.sweep()`` until :meth:`close`: at the earliest entry's expiry
    (so a silent instance is out within a few ms of its TTL), and at least every ``interval_s``.
    In the steady state (every instance heartbeating) that is about once per TTL minus one
    heartbeat interval, whatever the number of instances. Supervised (``kvwire-registry-sweeper`` on
    ``board``): a sweep that raises is logged and retried after a backoff; liveness depends on it."""

    def __init__(self, registry: Registry, interval_s: float, *, board: HealthBoard | None = None) -> None:
        self._registry = registry
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = SupervisedThread("kvwire-registry-sweeper", self._run, self._stop, board=board)

    def start(self) -> RegistrySweeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._next_wait()):
            self._registry.sweep()

    def _next_wait(self) -> float:
        due = self._registry.seconds_to_next_change()
        if due is None:  # an entry registered from now on expires a TTL from now at the earliest
            return min(self._interval_s, self._registry.ttl_s)
        return min(self._interval_s, max(_MIN_SWEEP_WAIT_S, due + _SWEEP_MARGIN_S))

    def close(self) -> None:
        self._thread.stop()
