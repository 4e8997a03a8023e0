"""Records which kvwire source files a process executes, for ``tests/support/request_trace.py``.

Put on ``PYTHONPATH`` (with ``KVWIRE_TRACE_DIR`` and ``KVWIRE_TRACE_ROOT`` set) by the tracer only;
a process started without ``KVWIRE_TRACE_DIR`` loads nothing. A profile hook (``sys.setprofile`` and
``threading.setprofile``) sees every Python call; it keeps, while recording, each call into a file
under ``KVWIRE_TRACE_ROOT`` (the ``kvwire`` package directory): the monotonic time (one clock for every
process of the host), the thread, the file, the function and the file of the nearest kvwire caller on
the stack. A daemon thread reads ``KVWIRE_TRACE_DIR/control`` every 20 ms: ``record`` starts recording
(acknowledged by ``<pid>.recording``), ``dump`` writes ``<pid>.json`` and stops. Recording stops by
itself after ``MAX_EVENTS`` events (the dump says so).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any

MAX_EVENTS = 2_000_000
CALLER_DEPTH = 12  # frames walked up (through library code) to find the kvwire caller
POLL_S = 0.02

_dir = os.environ.get("KVWIRE_TRACE_DIR", "")
_root = os.environ.get("KVWIRE_TRACE_ROOT", "").rstrip("/") + "/"
_recording = False
_truncated = False
_events: list[tuple[float, int, str, str, str]] = []
_files: dict[CodeType, str] = {}  # code object -> path under the root, "" when outside
_thread_names: dict[int, str] = {}


def _relative(code: CodeType) -> str:
    rel = _files.get(code)
    if rel is None:
        name = code.co_filename
        rel = name[len(_root):] if name.startswith(_root) else ""
        _files[code] = rel
    return rel


def _caller(frame: FrameType) -> str:
    back = frame.f_back
    for _ in range(CALLER_DEPTH):
        if back is None:
            return ""
        rel = _relative(back.f_code)
        if rel:
            return rel
        back = back.f_back
    return ""


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    global _recording, _truncated
    if event != "call" or not _recording:
        return
    code = frame.f_code
    rel = _relative(code)
    if not rel:
        return
    ident = threading.get_ident()
    if ident not in _thread_names:
        _thread_names[ident] = threading.current_thread().name
    _events.append((time.monotonic(), ident, rel, code.co_name, _caller(frame)))
    if len(_events) >= MAX_EVENTS:
        _recording, _truncated = False, True


def _dump() -> None:
    path = os.path.join(_dir, f"{os.getpid()}.json")
    names = {str(ident): name for ident, name in _thread_names.items()}
    body = {"pid": os.getpid(), "argv": sys.argv, "threads": names, "truncated": _truncated,
            "events": _events}
    with open(path + ".tmp", "w") as out:
        json.dump(body, out)
    os.replace(path + ".tmp", path)


def _watch() -> None:
    global _recording
    control = os.path.join(_dir, "control")
    state = ""
    while True:
        time.sleep(POLL_S)
        try:
            with open(control) as handle:
                wanted = handle.read().strip()
        except OSError:
            continue
        if wanted == state:
            continue
        state = wanted
        if wanted == "record":
            _events.clear()
            _recording = True
            with open(os.path.join(_dir, f"{os.getpid()}.recording"), "w"):
                pass
        elif wanted == "dump":
            _recording = False
            _dump()


if _dir and _root != "/":
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_watch, name="kvwire-request-trace", daemon=True).start()
