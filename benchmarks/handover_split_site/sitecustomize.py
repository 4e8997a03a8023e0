"""Wall-clock marks along the P -> D handover, for ``benchmarks/handover_split.py`` only (decision 162).

Loaded by every process started with this directory first on ``PYTHONPATH``; does something only in a
``kvwire serve`` process started with ``HANDOVER_SPLIT_DIR`` set. There it wraps the calls in
``MARKS`` so that each writes one line ``time.time() role thread call phase [message type]`` to
``HANDOVER_SPLIT_DIR/<role>-<pid>.log`` at entry (``in``) and, where asked, at exit (``out``);
D's ``_observe_exposed`` also writes the request's ``kv_ready_unix_s`` and landing time (the
handover's two ends, from the trailer). The lines are written as they happen (O_APPEND), so a
process that is killed keeps what it marked.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# "module:Class": {call: (mark exit too, only when this attribute of self is truthy or "")}
MARKS: dict[str, dict[str, tuple[bool, str]]] = {
    "kvwire.connector.worker:_SendSide": {"send_saved": (True, "unsent"), "_start_agent_send": (True, "")},
    "kvwire.engine.model_runner:ModelRunner": {"_forward_and_sample": (True, "")},
    "kvwire.engine.llm_engine:LLMEngine": {"step": (True, "")},
    "kvwire.server.engine_loop:EngineLoop": {
        "_step": (True, ""), "wake": (False, ""), "_deliver": (False, ""),
    },
    "kvwire.transfer.agent:TransferAgent": {"send_blocks": (False, ""), "send_trailer": (False, "")},
    "kvwire.transfer.agent:ControlLoop": {"_send_now": (False, "")},
    "kvwire.transfer.core:Routes": {"on_message": (True, "")},
    "kvwire.transfer.core:Arrivals": {"maybe_complete": (False, "")},
    "kvwire.transfer.core:CompletionEvents": {"recvd": (False, "")},
    "kvwire.transfer.planes.shm.plane:ShmPlane": {"send": (True, "")},
    "kvwire.transfer.planes.shm.plane:Inbound": {"_written": (True, "")},
    "kvwire.transfer.planes.shm.send:Outbound": {"_write_direct": (True, ""), "_write": (True, "")},
}

_dir = os.environ.get("HANDOVER_SPLIT_DIR", "")
_fd = -1
_role = ""


def _mark(text: str) -> None:
    os.write(_fd, f"{time.time():.6f} {_role} {threading.current_thread().name} {text}\n".encode())


def _marked(name: str, fn: Callable[..., Any], out: bool, only_if: str) -> Callable[..., Any]:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if only_if and not getattr(self, only_if, None):
            return fn(self, *args, **kwargs)
        if name.endswith("_write_direct") and not (args[1:] and args[1]):
            return fn(self, *args, **kwargs)
        msg = next((a for a in args if type(a).__name__ in _MSGS), None)
        extra = f" {type(msg).__name__}" if msg is not None else ""
        _mark(f"{name} in{extra}")
        try:
            return fn(self, *args, **kwargs)
        finally:
            if out:
                _mark(f"{name} out{extra}")
    return wrapped


_MSGS = {"Offer", "Grant", "Ack", "Trailer", "Renew", "Pull", "Abort"}


def _install() -> None:
    from kvwire.connector import worker

    for where, calls in MARKS.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name, (out, only_if) in calls.items():
            setattr(cls, name, _marked(f"{cls_name}.{name}", getattr(cls, name), out, only_if))
    observe = worker._ReceiveSide._observe_exposed

    def marked_observe(self: Any, trailer: Any, timing: Any) -> None:
        landed = timing.done_unix_s if timing is not None and timing.done_unix_s else 0.0
        _mark(f"exposed in {trailer.kv_ready_unix_s} {landed}")
        observe(self, trailer, timing)

    worker._ReceiveSide._observe_exposed = marked_observe  # type: ignore[method-assign]


if _dir and "--role" in sys.argv:
    argv = sys.argv
    _role = argv[argv.index("--role") + 1]
    _fd = os.open(os.path.join(_dir, f"{_role}-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    _install()
