"""Supervised component threads: a thread that raises is restarted with backoff, or the process is
marked unhealthy. No component thread may exit silently.

Two kinds of thread:

- **Long-lived component loops** (discovery listener, heartbeat client, control loop, plane acceptors,
  completers, KV event forwarders) run as :class:`SupervisedThread`. Its ``body`` is the loop; it
  returns when the component's stop event is set. If it raises (or returns while the stop event is
  clear) the exception is logged with the component's name, counted, and the body runs again after a
  backoff (doubling from ``backoff_initial_s`` to ``backoff_max_s``). More than ``max_restarts``
  failures within ``window_s`` and the component is **dead**: its :class:`HealthBoard` lists it, the
  process's ``/health`` answers 503 naming it, and ``on_dead`` (if given) runs once. A body must be
  restartable: sockets and state it needs across runs belong to the component, not to the body.
- **Long-lived asyncio tasks** (the router's etcd watch) run under :func:`supervise_async`, the same
  rules on the event loop: cancelling the task is the stop.
- **One-shot workers** (one reader per accepted connection, a closer): :func:`guarded` wraps the
  target so that an exception is logged with the worker's name and counted on the board
  (``errors``); the worker is not restarted (its connection is gone) and the process stays healthy.

The :class:`HealthBoard` is owned by the process's edge (the server instance, the router app, the vLLM
plugin) and passed down to the components it builds; a component built without one gets a private
board (its restarts are still logged, nobody's ``/health`` reads them). :class:`SupervisionCollector`
exports the board to Prometheus: ``kvwire_component_restarts_total{component}``,
``kvwire_component_up{component}``, ``kvwire_thread_errors_total{component}`` and
``kvwire_limit_hits_total{limit}`` (bounds that refused or cut something, :meth:`HealthBoard.limit_hit`).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwire.errors import ConfigError

log = logging.getLogger(__name__)


class ComponentState(enum.Enum):
    RUNNING = "running"
    RESTARTING = "restarting"  # its body failed; it runs again after the backoff
    DEAD = "dead"  # failed more than max_restarts times within window_s: the process is unhealthy


@dataclass(frozen=True)
class RestartPolicy:
    """How a :class:`SupervisedThread` restarts its body."""

    max_restarts: int = 5  # failures tolerated within window_s; one more and the component is dead
    window_s: float = 60.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not (self.window_s > 0 and 0 <= self.backoff_initial_s <= self.backoff_max_s):
            raise ConfigError(f"bad restart policy: {self}")

    def backoff_s(self, attempt: int) -> float:
        """The wait before restart number ``attempt`` (1-based)."""
        return float(min(self.backoff_max_s, self.backoff_initial_s * (2 ** max(attempt - 1, 0))))


@dataclass(frozen=True)
class ComponentStatus:
    """One supervised component as the board sees it (immutable; safe on any thread)."""

    name: str
    state: ComponentState
    restarts: int
    last_error: str | None


@dataclass
class _Entry:
    name: str
    state: ComponentState = ComponentState.RUNNING
    restarts: int = 0
    last_error: str | None = None
    failures: collections.deque[float] = field(default_factory=collections.deque)


class HealthBoard:
    """The supervised components of one process and their state. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()
        # Totals by component name; they outlive the entries (a stopped component keeps its count).
        self._restarts: collections.Counter[str] = collections.Counter()
        self._errors: collections.Counter[str] = collections.Counter()
        self._limits: collections.Counter[str] = collections.Counter()

    def register(self, name: str) -> int:
        """A new running component; returns its key for :meth:`unregister` and the state updates."""
        with self._lock:
            key = next(self._ids)
            self._entries[key] = _Entry(name)
            return key

    def unregister(self, key: int) -> None:
        """The component stopped on purpose (close()): it no longer counts for health."""
        with self._lock:
            self._entries.pop(key, None)

    def failed(self, key: int, error: str, policy: RestartPolicy) -> ComponentState:
        """Record a failure of ``key``'s body; returns RESTARTING, or DEAD when over the policy."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return ComponentState.DEAD
            entry.last_error = error
            entry.failures.append(now)
            while entry.failures and entry.failures[0] < now - policy.window_s:
                entry.failures.popleft()
            if len(entry.failures) > policy.max_restarts:
                entry.state = ComponentState.DEAD
            else:
                entry.state = ComponentState.RESTARTING
                entry.restarts += 1
                self._restarts[entry.name] += 1
            return entry.state

    def running(self, key: int) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state is not ComponentState.DEAD:
                entry.state = ComponentState.RUNNING

    def mark_dead(self, key: int, error: str) -> None:
        """A component that cannot go on at all (e.g. its socket is gone) declares itself dead."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.state = ComponentState.DEAD
                entry.last_error = error

    def worker_error(self, name: str) -> None:
        """A one-shot worker (:func:`guarded`) raised."""
        with self._lock:
            self._errors[name] += 1

    def limit_hit(self, limit: str, amount: int = 1) -> None:
        """A component refused or cut something at one of its bounds (a connection over a listener's
        cap, a link past its deadline): ``kvwire_limit_hits_total{limit}``. ``limit`` is a fixed name
        (never peer data: label sets stay bounded)."""
        with self._lock:
            self._limits[limit] += amount

    def limit_hits(self) -> dict[str, int]:
        with self._lock:
            return dict(self._limits)

    def snapshot(self) -> list[ComponentStatus]:
        with self._lock:
            entries = list(self._entries.values())
            return [ComponentStatus(e.name, e.state, e.restarts, e.last_error) for e in entries]

    def dead(self) -> list[ComponentStatus]:
        """The dead components (empty: healthy as far as supervision knows)."""
        return [s for s in self.snapshot() if s.state is ComponentState.DEAD]

    def restarts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._restarts)

    def worker_errors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._errors)

    def health_body(self) -> dict[str, object] | None:
        """What ``/health`` adds when a component is dead (``None`` when none is): a 503 body part
        naming each dead component and its last error."""
        dead = self.dead()
        if not dead:
            return None
        return {
            "status": "component_dead",
            "reason": "dead: " + ", ".join(s.name for s in dead),
            "dead_components": [{"component": s.name, "error": s.last_error} for s in dead],
        }


class SupervisedThread:
    """Runs ``body`` on a daemon thread until ``stop`` is set, restarting it when it fails.

    ``body`` must return promptly once ``stop`` is set. ``on_dead(exc)`` runs on the thread, once, when
    the component gives up (e.g. to fail the component's pending work); the thread then exits.
    """

    def __init__(
        self,
        name: str,
        body: Callable[[], None],
        stop: threading.Event,
        *,
        board: HealthBoard | None = None,
        policy: RestartPolicy | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.name = name
        self._body = body
        self._stop = stop
        self.board = board if board is not None else HealthBoard()
        self._policy = policy or RestartPolicy()
        self._on_dead = on_dead
        self._key: int | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> SupervisedThread:
        self._key = self.board.register(self.name)
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Set ``stop``, join, and take the component off the board (stopped on purpose); False
        (logged) if the thread did not stop in time."""
        self._stop.set()
        self.join(timeout_s)
        if self._key is not None:
            self.board.unregister(self._key)
        if self._thread.is_alive():
            log.warning("thread %s did not stop within %.1f s", self.name, timeout_s)
            return False
        return True

    def _run(self) -> None:
        assert self._key is not None
        attempt = 0
        while not self._stop.is_set():
            try:
                self._body()
            except Exception as exc:  # every exception a hostile peer or a bug can raise
                error: BaseException = exc
                text = f"{type(exc).__name__}: {exc}"
            else:
                if self._stop.is_set():
                    return
                error = RuntimeError(f"{self.name} returned while not stopping")
                text = str(error)
            state = self.board.failed(self._key, text, self._policy)
            if state is ComponentState.DEAD:
                log.error("component %s is dead (failed %d times within %.0f s; last: %s): the process "
                          "reports unhealthy", self.name, self._policy.max_restarts + 1,
                          self._policy.window_s, text, exc_info=error)
                if self._on_dead is not None:
                    try:
                        self._on_dead(error)
                    except Exception:
                        log.exception("on_dead of %s failed", self.name)
                return
            attempt += 1
            backoff_s = self._policy.backoff_s(attempt)
            log.error("component %s failed (%s); restarting in %.2f s", self.name, text, backoff_s,
                      exc_info=error)
            if self._stop.wait(backoff_s):
                return
            self.board.running(self._key)


async def supervise_async(
    name: str, body: Callable[[], Awaitable[None]], *, board: HealthBoard | None = None,
    policy: RestartPolicy | None = None,
) -> None:
    """:class:`SupervisedThread` for an asyncio task: run ``body()`` until the task is cancelled (the
    component's stop), restarting it with backoff when it raises or returns; dead (on ``board``)
    after too many failures, and then this coroutine returns. Cancellation takes the component off
    the board (stopped on purpose)."""
    board = board if board is not None else HealthBoard()
    policy = policy or RestartPolicy()
    key = board.register(name)
    attempt = 0
    try:
        while True:
            try:
                await body()
                error: BaseException = RuntimeError(f"{name} returned while not stopping")
            except Exception as exc:  # every exception a hostile peer or a bug can raise
                error = exc
            text = f"{type(error).__name__}: {error}"
            if board.failed(key, text, policy) is ComponentState.DEAD:
                log.error("component %s is dead (failed %d times within %.0f s; last: %s): the process "
                          "reports unhealthy", name, policy.max_restarts + 1, policy.window_s, text,
                          exc_info=error)
                return
            attempt += 1
            backoff_s = policy.backoff_s(attempt)
            log.error("component %s failed (%s); restarting in %.2f s", name, text, backoff_s, exc_info=error)
            await asyncio.sleep(backoff_s)
            board.running(key)
    except asyncio.CancelledError:
        board.unregister(key)
        raise


def guarded(name: str, target: Callable[..., None], board: HealthBoard | None = None) -> Callable[..., None]:
    """``target`` wrapped for a one-shot worker thread: an exception is logged with ``name`` and counted
    on ``board`` (``kvwire_thread_errors_total``) instead of ending the thread unseen."""

    def run(*args: object) -> None:
        try:
            target(*args)
        except Exception:
            log.exception("thread %s failed", name)
            if board is not None:
                board.worker_error(name)

    return run


class SupervisionCollector:
    """Prometheus series of a :class:`HealthBoard`, read at scrape time."""

    def __init__(self, board: HealthBoard) -> None:
        self._board = board

    def collect(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily("kvwire_component_restarts", "supervised component threads "
                                       "restarted after a failure", labels=["component"])
        for name, count in sorted(self._board.restarts().items()):
            restarts.add_metric([name], count)
        yield restarts
        up = GaugeMetricFamily("kvwire_component_up", "1 while a supervised component runs (or restarts), "
                               "0 once it is dead", labels=["component"])
        for status in self._board.snapshot():
            up.add_metric([status.name], 0 if status.state is ComponentState.DEAD else 1)
        yield up
        errors = CounterMetricFamily("kvwire_thread_errors", "one-shot worker threads (one per connection) "
                                     "that raised", labels=["component"])
        for name, count in sorted(self._board.worker_errors().items()):
            errors.add_metric([name], count)
        yield errors
        limits = CounterMetricFamily("kvwire_limit_hits", "times a component refused or cut something at "
                                     "one of its bounds", labels=["limit"])
        for name, count in sorted(self._board.limit_hits().items()):
            limits.add_metric([name], count)
        yield limits
