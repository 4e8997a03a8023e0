"""Spans of a prefill instance's engine steps, for ``benchmarks/pd_step_spans.py`` only.

Loaded by every process started with this directory first on ``PYTHONPATH``; does something only in
a ``kvwire serve --role prefill`` process started with ``PD_STEP_SPANS_DIR`` set. There it wraps, on
the engine thread, ``LLMEngine.step`` and the calls listed in ``SPANS`` with wall-clock and
thread-CPU timers. A step that starts a new prompt is recorded with its kind (``pd``: it carries
``kv_transfer_params``; ``plain``: it does not), the wait from the request's arrival
(``RequestStream``) to the step's start, the step's wall and engine-thread CPU time, the CPU time
every thread of this process and the processes named in ``PD_STEP_SPANS_DIR/pids.json`` used
meanwhile (Linux per-thread and per-process CPU clocks), and each span's wall and CPU time; also
the CPU time each thread and process used from the request's arrival to the step, and the calls
listed in ``OTHER_SPANS`` made on the other threads (the transfer control loop's reads, decodes,
handlers by message type and sends; the HTTP loop's request parsing) from the arrival to the
step's end. The file ``PD_STEP_SPANS_DIR/dump`` (created by the driver) makes it write
``steps-N.json`` and start over. While ``PD_STEP_SPANS_DIR/defer`` exists (at a step's start), the
control thread reads no inbound message until that step ends (at most 20 ms): an experiment of
what P's step gains if D's early Grant waits for P's forward, not a behaviour of ``src/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SPANS = {
    "kvwire.engine.scheduler:Scheduler": ("postprocess",),
    "kvwire.connector.requests:RequestHooks": ("get_num_new_matched_tokens", "request_finished"),
    "kvwire.connector.scheduler:KvwireSchedulerConnector": ("plan_step", "report_step"),
    "kvwire.connector.worker:KvwireWorkerConnector": ("send_saved", "_apply_metadata", "_report"),
    "kvwire.connector.worker:_SendSide": ("announce", "promise", "finish_saves"),
    "kvwire.engine.model_runner:ModelRunner": ("_forward_and_sample",),
    "kvwire.transfer.agent:TransferAgent": ("promise", "start_send", "send_blocks", "poll"),
}
ENGINE_THREAD = "kvwire-engine"
# calls timed on every thread but the engine's (the transfer control loop, the HTTP event loop): each
# call's start, wall and thread-CPU time is kept, and a step's row sums those that started between its
# request's arrival and the step's end, by span name (``Routes.on_message`` by message type)
OTHER_SPANS = {
    "kvwire.transfer.core:Routes": ("on_message", "on_tick"),
    "kvwire.transfer.agent:ControlLoop": ("_drain_outbox", "_recv_frames", "_drain_inbound"),
    "kvwire.transfer.wire:Codec": ("encode", "decode"),
    "kvwire.server.generate:GenerationHandler": ("_prepare",),
    "kvwire.server.engine_loop:EngineLoop": ("_deliver",),
}
MAX_OTHER = 4096

_dir = os.environ.get("PD_STEP_SPANS_DIR", "")
_rows: list[dict[str, Any]] = []
_step: dict[str, Any] = {}  # the engine thread's current step
_arrivals: dict[str, float] = {}  # request id -> time.monotonic() at RequestStream
_lock = threading.Lock()
_pids: dict[str, int] = {}
# ``PD_STEP_SPANS_DIR/defer`` present at a step's start: the transfer control thread reads no inbound
# message until that step ends (at most 20 ms): what P's step gains if D's early Grant waits for it
_idle = threading.Event()  # clear while a step runs in that mode
_idle.set()
_defer = [False]
_arrival_clocks: dict[str, dict[str, int]] = {}  # request id -> CPU clocks at RequestStream
_other: list[tuple[float, str, int, int]] = []  # (time.monotonic() at the start, name, wall ns, CPU ns)


def _cpu_clocks() -> dict[str, int]:
    clocks = {}
    for thread in threading.enumerate():
        if thread.ident is not None:
            clocks["thread " + thread.name] = time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
    if not _pids:
        try:
            with open(os.path.join(_dir, "pids.json")) as f:
                _pids.update(json.load(f))
        except (OSError, ValueError):
            pass
    for name, pid in _pids.items():
        with contextlib.suppress(OSError):  # Linux: a process's CPU clock id is ((~pid) << 3) | 2
            clocks["process " + name] = time.clock_gettime_ns(((~pid) << 3) | 2)
    return clocks


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not _step or threading.current_thread().name != ENGINE_THREAD:
            return fn(*args, **kwargs)
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            span = _step["spans"].setdefault(name, [0, 0])
            span[0] += time.perf_counter_ns() - wall
            span[1] += time.thread_time_ns() - cpu
    return wrapped


def _timed_other(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == ENGINE_THREAD:
            return fn(*args, **kwargs)
        start, wall, cpu = time.monotonic(), time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            label = name
            if name.endswith("on_message") and args[1:]:
                label = f"{name}({type(args[1]).__name__})"
            with _lock:
                _other.append((start, label, time.perf_counter_ns() - wall, time.thread_time_ns() - cpu))
                del _other[:-MAX_OTHER]
    return wrapped


def _install() -> None:
    import importlib

    from kvwire.engine import llm_engine, scheduler
    from kvwire.server import generate

    stream_init = generate.RequestStream.__init__

    def new_stream(self: Any, request_id: str) -> None:
        stream_init(self, request_id)
        _arrivals[request_id] = self.arrival_s
        _arrival_clocks[request_id] = _cpu_clocks()

    generate.RequestStream.__init__ = new_stream  # type: ignore[method-assign]
    schedule = scheduler.Scheduler.schedule

    def timed_schedule(self: Any) -> Any:
        step = schedule(self)
        new = [s.request for s in step.scheduled if s.request.num_computed_tokens == 0]
        if new and _step:
            _step["kind"] = "pd" if any(r.kv_transfer_params is not None for r in new) else "plain"
            if len(new) < len(step.scheduled):
                _step["kind"] += "+decodes"
            _step["request_ids"] = [r.request_id for r in new]
        return step

    scheduler.Scheduler.schedule = _timed("Scheduler.schedule", timed_schedule)  # type: ignore[method-assign]
    engine_step = llm_engine.LLMEngine.step

    def timed_step(self: Any) -> Any:
        _step.clear()
        _defer[0] = os.path.exists(os.path.join(_dir, "defer"))
        if _defer[0]:
            _idle.clear()
        _step.update(spans={}, clocks=_cpu_clocks(), start=time.monotonic(), wall=time.perf_counter_ns(),
                     cpu=time.thread_time_ns(), mode="defer" if _defer[0] else "")
        try:
            return engine_step(self)
        finally:
            _idle.set()
            _record()

    llm_engine.LLMEngine.step = timed_step  # type: ignore[method-assign]
    for where, names in SPANS.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            setattr(cls, name, _timed(f"{cls_name}.{name}", getattr(cls, name)))
    from kvwire.transfer.agent import ControlLoop

    drain = ControlLoop._drain_inbound

    def deferred_drain(self: Any) -> None:
        _idle.wait(0.02)
        drain(self)

    ControlLoop._drain_inbound = deferred_drain  # type: ignore[method-assign]
    for where, names in OTHER_SPANS.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            setattr(cls, name, _timed_other(f"{cls_name}.{name}", getattr(cls, name)))


def _record() -> None:
    step, kind = dict(_step), _step.get("kind")
    _step.clear()
    if kind is None:
        return
    before, after = step["clocks"], _cpu_clocks()
    arrivals = [_arrivals.pop(r, step["start"]) for r in step["request_ids"]]
    at_arrival = [_arrival_clocks.pop(r, None) for r in step["request_ids"]]
    first = next((c for c in at_arrival if c is not None), before)
    end = time.monotonic()
    with _lock:
        others = [(n, w, c) for t, n, w, c in _other if min(arrivals) <= t <= end]
    other_spans: dict[str, list[float]] = {}
    for name, wall, cpu in others:
        span = other_spans.setdefault(name, [0.0, 0.0, 0])
        span[0] += wall / 1e3
        span[1] += cpu / 1e3
        span[2] += 1
    row = {
        "kind": kind + (f" ({step['mode']})" if step.get("mode") else ""),
        "queue_us": 1e6 * (step["start"] - min(arrivals)),
        "wall_us": (time.perf_counter_ns() - step["wall"]) / 1e3,
        "cpu_us": (time.thread_time_ns() - step["cpu"]) / 1e3,
        "cpu_us_meanwhile": {k: (v - before[k]) / 1e3 for k, v in after.items() if k in before},
        "cpu_us_before": {k: (v - first[k]) / 1e3 for k, v in before.items() if k in first},
        "other_spans": other_spans,
        "spans": {k: [wall / 1e3, cpu / 1e3] for k, (wall, cpu) in step["spans"].items()},
    }
    with _lock:
        _rows.append(row)


def _dump_on_request() -> None:
    count = 0
    while True:
        time.sleep(0.05)
        control = os.path.join(_dir, "dump")
        if not os.path.exists(control):
            continue
        os.remove(control)
        with _lock:
            rows = list(_rows)
            _rows.clear()
        count += 1
        with open(os.path.join(_dir, f"steps-{count}.json"), "w") as f:
            json.dump(rows, f)


if _dir and "serve" in sys.argv and "prefill" in sys.argv:
    _install()
    threading.Thread(target=_dump_on_request, name="pd-step-spans", daemon=True).start()
