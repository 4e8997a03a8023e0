"""Spans of a prefill instance's engine steps, for ``benchmarks/pd_step_spans.py`` only.

Loaded by every process started with this directory first on ``PYTHONPATH``; does something only in
a ``kvwire serve --role prefill`` process started with ``PD_STEP_SPANS_DIR`` set. There it wraps, on
the engine thread, ``LLMEngine.step`` and the calls listed in ``SPANS`` with wall-clock and
thread-CPU timers. A step that starts a new prompt is recorded with its kind (``pd``: it carries
``kv_transfer_params``; ``plain``: it does not), the wait from the request's arrival
(``RequestStream``) to the step's start, the step's wall and engine-thread CPU time, the CPU time
every thread of this process and the processes named in ``PD_STEP_SPANS_DIR/pids.json`` used
meanwhile (Linux per-thread and per-process CPU clocks), and each span's wall and CPU time. The
file ``PD_STEP_SPANS_DIR/dump`` (created by the driver) makes it write ``steps-N.json`` and start
over.
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

_dir = os.environ.get("PD_STEP_SPANS_DIR", "")
_rows: list[dict[str, Any]] = []
_step: dict[str, Any] = {}  # the engine thread's current step
_arrivals: dict[str, float] = {}  # request id -> time.monotonic() at RequestStream
_lock = threading.Lock()
_pids: dict[str, int] = {}


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


def _install() -> None:
    import importlib

    from kvwire.engine import llm_engine, scheduler
    from kvwire.server import generate

    stream_init = generate.RequestStream.__init__

    def new_stream(self: Any, request_id: str) -> None:
        stream_init(self, request_id)
        _arrivals[request_id] = self.arrival_s

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
        _step.update(spans={}, clocks=_cpu_clocks(), start=time.monotonic(),
                     wall=time.perf_counter_ns(), cpu=time.thread_time_ns())
        try:
            return engine_step(self)
        finally:
            _record()

    llm_engine.LLMEngine.step = timed_step  # type: ignore[method-assign]
    for where, names in SPANS.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            setattr(cls, name, _timed(f"{cls_name}.{name}", getattr(cls, name)))


def _record() -> None:
    step, kind = dict(_step), _step.get("kind")
    _step.clear()
    if kind is None:
        return
    before, after = step["clocks"], _cpu_clocks()
    arrivals = [_arrivals.pop(r, step["start"]) for r in step["request_ids"]]
    row = {
        "kind": kind,
        "queue_us": 1e6 * (step["start"] - min(arrivals)),
        "wall_us": (time.perf_counter_ns() - step["wall"]) / 1e3,
        "cpu_us": (time.thread_time_ns() - step["cpu"]) / 1e3,
        "cpu_us_meanwhile": {k: (v - before[k]) / 1e3 for k, v in after.items() if k in before},
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
