"""Runs ``LLMEngine.step`` on one dedicated thread and bridges it to asyncio.

Threads: the engine is touched only by the engine thread (started by :meth:`EngineLoop.start`).
The asyncio side sends it commands (add, abort, abort-all, stop) through a queue and receives each
step's outputs through ``loop.call_soon_threadsafe``, put into the outbox (an ``asyncio.Queue``) the
caller gave each request. While only remote-KV transfers are pending the thread polls every
``remote_wait_s``; a transfer that ends wakes it at once (:meth:`EngineLoop.wake`, decision 153). When
the transfer agent wakes it (``wakes_on_receive``) and nothing holds blocks for a send, only receives
are awaited and the poll is ``receive_wait_s`` (decision 158). A step that finishes a request whose
blocks wait for a send wakes the thread once its outputs are handed to their writers, so P's held
push starts then rather than a poll later (decision 161).
Failure: an exception from ``add_request`` is raised to the awaiting caller; an
exception from ``step`` fails every in-flight request with :class:`EngineError` (their streams
raise it) and the loop keeps serving new requests; after ``MAX_CONSECUTIVE_STEP_ERRORS`` failed steps in
a row, or any other exception, the thread stops, ``alive`` turns false (``/health`` reports 503) and new
requests get :class:`EngineError` (500). A lost tensor-parallel rank (:class:`RankLost`, from a step
or from the idle check every ``RANK_CHECK_S``) stops the thread at once: ``on_lost`` is posted first
(the server stops taking requests), then every in-flight request fails with it (503
``instance_lost``). A thread that stops making progress (a step stuck in a GPU op)
while requests wait is caught by the :class:`~kvwire.server.stall_watchdog.StallWatchdog` when
``stall_timeout_s`` is set: the waiting requests fail with :class:`EngineStalled` (503), new ones are
refused with it, and serving resumes by itself once the stuck call returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvwire.errors import (  # the last still importable here
    EngineError,
    EngineStalled,
    RankLost,
    ServerShuttingDown,
)
from kvwire.protocol.kv_params import KVParams
from kvwire.server.stall_watchdog import StallWatchdog

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_ERRORS = 5  # then the engine is considered broken and the thread stops
_LIVENESS_CHECK_S = 1.0  # how often a caller waiting for the engine thread checks that it still runs
_ERROR_BACKOFF_S = 0.05  # wait before the next step after a failed one, times the failures in a row
RANK_CHECK_S = 1.0  # while idle, how often the engine's tensor-parallel ranks are checked (check_ranks)


# --- what the loop reports: immutable values, safe to read on any thread (/health, /metrics, the
# heartbeat thread) -------------------------------------------------------------------------------


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
    num_delayed_free_requests: int = 0  # finished requests whose blocks wait for a send to complete
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    num_prefix_cache_hit_tokens: int = 0  # prompt tokens found in the local prefix cache, since start
    # time.monotonic() when copied: the loop refreshes the snapshot between engine steps, so during a
    # long step it lags the live connector/transfer metrics (exported as its age)
    taken_at: float = dataclasses.field(default_factory=time.monotonic)

    @classmethod
    def of(cls, stats: Any) -> StatsSnapshot:
        return cls(**{name: int(getattr(stats, name, 0) or 0) for name in _SNAPSHOT_COUNTS})

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the snapshot was copied."""
        return max(0.0, (time.monotonic() if now is None else now) - self.taken_at)


# StatsSnapshot's counters: taken after every engine step, so listed once, not per snapshot
_SNAPSHOT_COUNTS = tuple(f.name for f in dataclasses.fields(StatsSnapshot) if f.name != "taken_at")


class EngineLike(Protocol):
    """The part of ``kvwire.engine.LLMEngine`` the server uses."""

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: Any,
        kv_transfer_params: KVParams | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> Sequence[Any]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class TimedOutput:
    output: Any  # kvwire.engine.RequestOutput
    time_s: float  # time.monotonic() when the step that produced it ended


# Where the loop puts a request's outputs, on the event loop's thread: each TimedOutput in order, or
# the exception that ends the request (the HTTP handler gives a
# :class:`~kvwire.server.generate.RequestStream`).
RequestOutbox = asyncio.Queue[TimedOutput | BaseException]


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    kv_transfer_params: KVParams | None
    done: concurrent.futures.Future[None]


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _AbortAll:
    reason: str


class _Stop:
    pass


class _Wake:
    """Step now: something the next step reports has happened (a KV transfer ended)."""


_Command = _Add | _Abort | _AbortAll | _Stop | _Wake


class EngineLoop:
    """Owns the engine thread. ``start`` and all async methods run on the event loop's thread."""

    def __init__(
        self, engine: EngineLike, *, idle_wait_s: float = 0.05, remote_wait_s: float = 0.002,
        receive_wait_s: float = 0.02, stall_timeout_s: float | None = None,
        on_lost: Callable[[RankLost], None] | None = None,
    ) -> None:
        """``on_lost(error)``: called on the event loop when the engine lost a tensor-parallel rank
        (before the in-flight requests are failed with it); the instance cannot serve any more.
        ``receive_wait_s``: the poll while only receives are awaited and ``wakes_on_receive`` is set
        (a receive that ends or fails wakes the loop; the poll is the safety net, decision 158)."""
        self._engine = engine
        self._on_lost = on_lost
        self.fatal: BaseException | None = None  # why the engine thread stopped, if it failed
        self._rank_check_s = 0.0  # monotonic time of the last idle rank check
        self._idle_wait_s = idle_wait_s  # block this long on the queue when nothing is in flight
        self._remote_wait_s = remote_wait_s  # ... and this long when all wait for KV transfers
        self._receive_wait_s = receive_wait_s  # ... or this long when all wait for receives that wake us
        # set by the server once the transfer agent calls ``wake`` when a receive ends or fails
        self.wakes_on_receive = False
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake_queued = False  # a _Wake is in the queue: more wakes add none (races add one more)
        self._streams: dict[str, RequestOutbox] = {}  # event-loop thread only: outboxes in flight
        self._adding: dict[str, concurrent.futures.Future[None]] = {}  # event-loop thread: adds not taken yet
        self._live: set[str] = set()  # engine thread only: ids added and not finished
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = StatsSnapshot.of(engine.stats())
        self._closing = False
        self.num_step_errors = 0
        self._consecutive_step_errors = 0
        self._progress_s = time.monotonic()  # written by the engine thread after every iteration
        self._watchdog: StallWatchdog | None = None  # None: stall_timeout_s None or 0 (disabled)
        if stall_timeout_s:
            self._watchdog = StallWatchdog(
                stall_timeout_s, progress_fn=lambda: self._progress_s,
                busy_fn=lambda: self.alive and bool(self._streams), on_stall=self._fail_in_flight,
            )

    # --- event-loop side -----------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kvwire-engine", daemon=True)
        self._thread.start()
        if self._watchdog is not None:
            self._watchdog.start(loop)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stall_timeout_s(self) -> float | None:
        """The stall watchdog's timeout; None when it is off."""
        return self._watchdog.timeout_s if self._watchdog is not None else None

    def status(self) -> EngineStatus:
        num_stalls = self._watchdog.num_stalls if self._watchdog is not None else 0
        if not self.alive:
            reason = str(self.fatal) if self.fatal is not None else "the engine thread is not running"
            return EngineStatus(EngineHealth.STOPPED, reason, num_stalls)
        if self._watchdog is not None and self._watchdog.stalled:
            return EngineStatus(EngineHealth.STALLED, self._watchdog.reason(time.monotonic()), num_stalls)
        return EngineStatus(num_stalls=num_stalls)

    @property
    def stats(self) -> StatsSnapshot:
        return self._stats

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests admitted and not computing (waiting for a batch slot or for remote KV): the
        streams in flight less those the engine ran at its last report."""
        return max(0, len(self._streams) - self._stats.num_running)

    async def add_request(
        self, request_id: str, outbox: RequestOutbox, prompt_token_ids: list[int], params: Any,
        kv_transfer_params: KVParams | None = None,
    ) -> None:
        """Hand a request to the engine; its outputs go to ``outbox``, until the finished one (or the
        exception that ends it). Raises what ``engine.add_request`` raised."""
        if self._closing:
            raise ServerShuttingDown("the server is shutting down")
        if not self.alive:
            if isinstance(self.fatal, RankLost):
                raise self.fatal
            raise EngineError("the engine thread is not running")
        if self._watchdog is not None and self._watchdog.check(time.monotonic()):
            raise EngineStalled(self._watchdog.reason(time.monotonic()))
        if request_id in self._streams:
            raise EngineError(f"duplicate request id {request_id}")
        self._streams[request_id] = outbox
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._adding[request_id] = done
        self._commands.put(_Add(request_id, prompt_token_ids, params, kv_transfer_params, done))
        try:
            await self._accepted(done)
        except BaseException:
            self.abort(request_id)
            raise
        finally:
            del self._adding[request_id]

    async def _accepted(self, done: concurrent.futures.Future[None]) -> None:
        """Wait for the engine thread to take the request; fail if the thread dies meanwhile.

        A cancellation (the client went away) always reaches the caller, which then aborts the
        request, also when the engine thread takes it in the same loop iteration. Hence
        ``asyncio.wait`` and not ``asyncio.wait_for``, which before Python 3.12 returns then (CPython
        gh-86296): the request would stay in the engine for a client that is gone (decision 146)."""
        waiter = asyncio.wrap_future(done)
        while True:
            taken, _ = await asyncio.wait({waiter}, timeout=_LIVENESS_CHECK_S)
            if taken:
                waiter.result()  # raises what the engine's add_request raised
                return
            if not self.alive:  # our add fails now, queued or taken by a thread that died holding it
                error = EngineError("the engine thread is not running")
                self._refuse_pending(error)
                _resolve(done, error)  # the next wait returns at once

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its blocks are freed by the engine. Idempotent."""
        self._streams.pop(request_id, None)
        self._commands.put(_Abort(request_id))

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight request; their streams raise :class:`ServerShuttingDown`."""
        self._commands.put(_AbortAll(reason))

    def wake(self) -> None:
        """Any thread: have the engine thread step now instead of at the end of its poll wait, for a
        KV transfer that ended (D's request can decode; a failed one is reported). The poll stays the
        safety net: nothing depends on a wake arriving (decision 153)."""
        if not self._wake_queued:
            self._wake_queued = True
            self._commands.put(_Wake())

    def close(self, timeout_s: float) -> bool:
        """Stop the engine thread (aborting what is in flight). Returns False if it did not stop in time."""
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._thread is None:
            return True
        self._closing = True
        self._commands.put(_Stop())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self._refuse_pending(ServerShuttingDown("the server is shutting down"))
        return True

    def _deliver(self, outputs: Sequence[Any], time_s: float, wake: bool = False) -> None:
        """Event loop: hand a step's outputs to their requests' outboxes; with ``wake``, wake the
        engine thread once the writers those outputs woke have run (scheduled after them)."""
        for output in outputs:
            outbox = self._streams.get(output.request_id)
            if outbox is None:
                continue  # aborted meanwhile
            outbox.put_nowait(TimedOutput(output, time_s))
            if output.finished:
                del self._streams[output.request_id]
        if wake and self._loop is not None:
            self._loop.call_soon(self.wake)

    def _fail(self, request_ids: Sequence[str], error: BaseException) -> None:
        for request_id in request_ids:
            outbox = self._streams.pop(request_id, None)
            if outbox is not None:
                outbox.put_nowait(error)

    def _fail_in_flight(self, error: EngineStalled) -> None:
        """The watchdog saw a stall: every waiting request fails with ``error`` now (adds not yet taken
        are refused), and its abort is queued, so the engine drops it once the thread resumes."""
        for done in self._adding.values():
            _resolve(done, error)
        streams, self._streams = self._streams, {}
        for request_id, outbox in streams.items():
            outbox.put_nowait(error)
            self._commands.put(_Abort(request_id))

    def _post(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            self._loop.call_soon_threadsafe(callback, *args)

    # --- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException = ServerShuttingDown("the server is shutting down")
        try:
            while self._drain_commands():
                if self._engine.has_unfinished_requests():
                    self._step()
                else:
                    self._check_ranks()
                self._progress_s = time.monotonic()  # read by the stall watchdog
        except Exception as exc:
            if isinstance(exc, RankLost):
                logger.error("engine stopped: %s", exc)
                error = exc
            else:
                logger.exception("engine thread crashed")
                error = EngineError(f"the engine failed: {exc}")
            self.fatal = error
            if isinstance(error, RankLost) and self._on_lost is not None:
                self._post(self._on_lost, error)
        finally:
            self._abort_live(error)
            self._refuse_pending(error)
            logger.info("engine thread stopped")

    def _check_ranks(self) -> None:
        """While idle, at most every RANK_CHECK_S: a lost rank is found before the next request."""
        now = time.monotonic()
        check = getattr(self._engine, "check_ranks", None)
        if check is not None and now - self._rank_check_s >= RANK_CHECK_S:
            self._rank_check_s = now
            check()

    def _refuse_pending(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                _resolve(command.done, error)

    def _drain_commands(self) -> bool:
        """Apply queued commands; block a little when idle. Returns False on stop."""
        if self._consecutive_step_errors:
            wait_s: float | None = _ERROR_BACKOFF_S * self._consecutive_step_errors  # do not spin on errors
        elif not self._engine.has_unfinished_requests():
            wait_s = self._idle_wait_s
        elif self._stats.num_running == 0 and self._stats.num_waiting == 0:
            # Nothing to compute: only remote-KV waiters or blocks held for a send. Poll, do not spin;
            # a transfer that ends wakes the loop at once (``wake``).
            wait_s = self._poll_wait_s()
        else:
            wait_s = None
        while True:
            try:
                command = self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait()
            except queue.Empty:
                return True
            wait_s = None
            if not self._apply(command):
                return False

    def _poll_wait_s(self) -> float:
        """The poll while nothing computes: ``remote_wait_s`` while blocks wait for a send (P starts
        its held push at its next step, decision 147, and learns of the send's end only by polling)
        or when no agent wakes the loop; ``receive_wait_s`` when only receives are awaited and their
        end wakes it (D between its admission and the last layer: no empty step every 2 ms)."""
        if self.wakes_on_receive and self._stats.num_delayed_free_requests == 0:
            return self._receive_wait_s
        return self._remote_wait_s

    def _apply(self, command: _Command) -> bool:
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Wake):
            self._wake_queued = False  # the step that follows sees what the waker saw
            return True
        if isinstance(command, _Add):
            self._apply_add(command)
        elif isinstance(command, _Abort):
            if command.request_id in self._live:
                self._live.discard(command.request_id)
                self._engine.abort_request(command.request_id)
        else:
            self._abort_live(ServerShuttingDown(command.reason))
        self._stats = StatsSnapshot.of(self._engine.stats())
        return True

    def _apply_add(self, command: _Add) -> None:
        try:
            self._engine.add_request(
                command.request_id, command.prompt_token_ids, command.params, command.kv_transfer_params
            )
        except Exception as exc:
            _resolve(command.done, exc)
            return
        self._live.add(command.request_id)
        _resolve(command.done, None)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except RankLost:
            self.num_step_errors += 1
            raise  # the engine is over: _run stops the thread and fails every request with it
        except Exception as exc:
            self.num_step_errors += 1
            self._consecutive_step_errors += 1
            logger.exception("engine step failed; failing %d in-flight requests", len(self._live))
            self._abort_live(EngineError(f"engine step failed: {exc}"))
            if self._consecutive_step_errors >= MAX_CONSECUTIVE_STEP_ERRORS:
                # A broken engine: stop the thread so /health turns 503 and the router drops us.
                raise EngineError(f"{self._consecutive_step_errors} engine steps failed in a row") from exc
            return
        finally:
            self._stats = StatsSnapshot.of(self._engine.stats())
        self._consecutive_step_errors = 0
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
        if outputs:
            # A request that finished with its blocks held for a send (P's push starts at its next
            # step, decision 147): that step runs once the tokens are written, not a poll later
            # (decision 161)
            wake = self._stats.num_delayed_free_requests > 0 and any(o.finished for o in outputs)
            self._post(self._deliver, list(outputs), time.monotonic(), wake)

    def _abort_live(self, error: BaseException) -> None:
        request_ids = list(self._live)
        self._live.clear()
        for request_id in request_ids:
            try:
                self._engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        if request_ids:
            self._post(self._fail, request_ids, error)
        self._stats = StatsSnapshot.of(self._engine.stats())


def _resolve(done: concurrent.futures.Future[None], error: BaseException | None) -> None:
    """Complete an add's future unless its waiter already gave up (cancelled it)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
