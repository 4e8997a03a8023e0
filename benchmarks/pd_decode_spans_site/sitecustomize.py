"""Thread-CPU spans of a decode instance, for ``benchmarks/pd_decode_spans.py`` only (decision 158).

Loaded by every process started with this directory first on ``PYTHONPATH``; does something only in
a ``kvwire serve --role decode`` process started with ``PD_DECODE_SPANS_DIR`` set. There it wraps
the calls listed in ``SPANS`` (the HTTP admission, the engine loop, the engine's step and its
connector work, the receive side's ``expect`` and early grant, the control thread's handlers) with
a thread-CPU timer, keyed by thread and call; calls made in an engine step that scheduled nothing
(D's admission step, its polls while it waits for KV, the step its KV's arrival wakes) are keyed
``E:``. The file ``PD_DECODE_SPANS_DIR/start`` makes it note the counters and every thread's on-CPU
time (``/proc/self/task/*/schedstat``); ``dump`` makes it write the differences since to
``spans.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SPANS = {
    "kvwire.server.generate:GenerationHandler": ("_prepare",),
    "kvwire.server.engine_loop:EngineLoop": ("_apply_add", "_step", "_drain_commands"),
    "kvwire.engine.llm_engine:LLMEngine": ("step", "add_request"),
    "kvwire.engine.scheduler:Scheduler": ("postprocess", "apply_report"),
    "kvwire.engine.model_runner:ModelRunner": ("_forward_and_sample",),
    "kvwire.connector.worker:KvwireWorkerConnector": ("_apply_metadata", "run_step", "_report"),
    "kvwire.connector.scheduler:KvwireSchedulerConnector": ("plan_step", "report_step"),
    "kvwire.connector.requests:RequestHooks": ("get_num_new_matched_tokens", "check_request_params"),
    "kvwire.transfer.core:Receiver": ("expect", "on_control"),
    "kvwire.transfer.core:Credit": ("grant_early",),
    "kvwire.transfer.core:Routes": ("on_tick", "on_message"),
    "kvwire.transfer.agent:ControlLoop": ("_drain_inbound", "_drain_outbox"),
}

_dir = os.environ.get("PD_DECODE_SPANS_DIR", "")
_acc: dict[tuple[str, str], list[int]] = {}  # (thread, call) -> [calls, CPU ns]
_lock = threading.Lock()
_local = threading.local()  # .empty: the engine thread is in a step that scheduled nothing


def _add(key: tuple[str, str], cpu_ns: int) -> None:
    with _lock:
        entry = _acc.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += cpu_ns


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cpu = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            prefix = "E:" if getattr(_local, "empty", False) else ""
            _add((threading.current_thread().name, prefix + name), time.thread_time_ns() - cpu)
    return wrapped


def _install() -> None:
    from kvwire.engine import llm_engine, scheduler

    schedule = scheduler.Scheduler.schedule

    def marked_schedule(self: Any) -> Any:
        step = schedule(self)
        _local.empty = not step.scheduled
        return step

    scheduler.Scheduler.schedule = marked_schedule  # type: ignore[method-assign]
    for where, names in SPANS.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            setattr(cls, name, _timed(f"{cls_name}.{name}", getattr(cls, name)))
    step = llm_engine.LLMEngine.step

    def counted_step(self: Any) -> Any:
        _local.empty = False
        try:
            return step(self)
        finally:
            _local.empty = False

    llm_engine.LLMEngine.step = counted_step  # type: ignore[method-assign]


def _threads() -> dict[str, int]:
    clocks = {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError):
            continue
        clocks[names.get(int(tid), f"native {tid}")] = ns
    return clocks


def _minus(now: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(now, before, strict=True)]


def _serve_files() -> None:
    base_threads: dict[str, int] = {}
    base_spans: dict[tuple[str, str], list[int]] = {}
    while True:
        time.sleep(0.05)
        for control in ("start", "dump"):
            path = os.path.join(_dir, control)
            if not os.path.exists(path):
                continue
            os.remove(path)
            with _lock:
                spans = {k: list(v) for k, v in _acc.items()}
            threads = _threads()
            if control == "start":
                base_threads, base_spans = threads, spans
                continue
            out = {
                "spans": {f"{k[0]}|{k[1]}": _minus(v, base_spans.get(k, [0, 0])) for k, v in spans.items()},
                "threads": {k: v - base_threads.get(k, 0) for k, v in threads.items()},
            }
            with open(os.path.join(_dir, "spans.json.tmp"), "w") as f:
                json.dump(out, f)
            os.replace(os.path.join(_dir, "spans.json.tmp"), os.path.join(_dir, "spans.json"))


if _dir and "serve" in sys.argv and "decode" in sys.argv:
    _install()
    threading.Thread(target=_serve_files, name="pd-decode-spans", daemon=True).start()
