"""Wall-clock marks along a request's path to its first token, for ``benchmarks/first_token_split.py``.

Loaded by every process started with this directory first on ``PYTHONPATH``; does something only
with ``FIRST_TOKEN_SPLIT_DIR`` set: in ``kvwire serve`` (role from ``--role``), ``kvwire router`` and
the ``bench serve`` client. Each wrapped call writes ``time.time() role thread call phase`` to
``FIRST_TOKEN_SPLIT_DIR/<role>-<pid>.log`` at entry (``in``) and, where asked, at exit (``out``).
Nothing in ``src/`` changes.

Probe switches (environment, set by the script's flags), each an experiment of decision 164:
``FIRST_TOKEN_SPLIT_HOLD_D`` (the router calls D only once P answered), ``FIRST_TOKEN_SPLIT_DEFER``
(P's control thread handles no message while its engine thread runs a forward, at most 20 ms),
``FIRST_TOKEN_SPLIT_SWITCH_S`` (the instances' GIL switch interval), ``FIRST_TOKEN_SPLIT_SLICE_MS``
(the engine threads' EEVDF slice, through ``sched_setattr``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

INSTANCE = {
    "kvwire.server.generate:GenerationHandler": {
        "_handle_one": False, "_prepare": True, "_admit": True, "read_body": True, "_kv_params": True,
    },
    "kvwire.server.engine_loop:EngineLoop": {"_step": True, "_deliver": False, "add_request": False},
    "kvwire.engine.llm_engine:LLMEngine": {"step": True},
    "kvwire.engine.model_runner:ModelRunner": {"_forward_and_sample": True, "_prepare": True},
    "kvwire.engine.models.llama:DecoderLayer": {"forward": True},
    "kvwire.engine.models.llama:LlamaModel": {"compute_logits": True},
    "kvwire.http.front_door:ClientWriter": {"write": True, "send_body": True},
    "kvwire.transfer.agent:ControlLoop": {"_drain_inbound": True},
    "kvwire.connector.requests:RequestHooks": {"check_request_params": True, "_check_layout": True},
    "kvwire.connector.worker:_SendSide": {"promise": True},
    "kvwire.protocol.kv_signing:ParamsVerifier": {"verify": True},
    "kvwire.transfer.agent:TransferAgent": {"promise": True},
}
ROUTER = {
    "kvwire.router.dispatcher:Dispatcher": {"dispatch": False},
    "kvwire.router.dispatcher:PushPath": {"serve": False, "pick": True},
    "kvwire.router.dispatcher:PdParams": {"push": True},
    "kvwire.router.relay:Relay": {"call": False, "open_stream": True, "relay": False},
    "kvwire.router.relay:Upstream": {"read_all": True, "open": True},
    "kvwire.router.relay:ClientStream": {"write": True},
    "kvwire.http.front_door:ClientWriter": {"open": True, "write": True},
}

_dir = os.environ.get("FIRST_TOKEN_SPLIT_DIR", "")
_DEFER = bool(os.environ.get("FIRST_TOKEN_SPLIT_DEFER"))
# per-layer marks with the engine thread's CPU time and context switches (adds overhead: opt-in)
_DETAIL = bool(os.environ.get("FIRST_TOKEN_SPLIT_LAYERS"))
_SLICE_NS = int(float(os.environ.get("FIRST_TOKEN_SPLIT_SLICE_MS") or 0) * 1e6)
_tls = threading.local()


def _set_slice(ns: int) -> None:
    """Probe: this thread's EEVDF slice (sched_setattr, SCHED_OTHER, sched_runtime = ns)."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    attr = struct.pack("=IIQiIQQQ", 48, 0, 0, 0, 0, ns, 0, 0)
    buf = ctypes.create_string_buffer(attr)
    rc = libc.syscall(314, 0, buf, 0)
    _mark(f"slice-set rc={rc} errno={ctypes.get_errno()}")
_idle = threading.Event()
_idle.set()
_fd = -1
_role = ""


def _mark(text: str) -> None:
    os.write(_fd, f"{time.time():.6f} {_role} {threading.current_thread().name} {text}\n".encode())


def _usage(text: str) -> None:
    """A mark with the thread's CPU seconds and involuntary context switches so far."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    _mark(f"{text} {time.thread_time():.6f} {ru.ru_nivcsw} {ru.ru_nvcsw}")


def _wrap(name: str, fn: Callable[..., Any], out: bool) -> Callable[..., Any]:
    import inspect

    if inspect.iscoroutinefunction(fn):
        async def awrapped(*args: Any, **kwargs: Any) -> Any:
            _mark(f"{name} in")
            try:
                return await fn(*args, **kwargs)
            finally:
                if out:
                    _mark(f"{name} out")
        return awrapped

    if name == "ModelRunner._forward_and_sample":
        def used(*args: Any, **kwargs: Any) -> Any:
            if _SLICE_NS and not getattr(_tls, "sliced", False):
                _tls.sliced = True
                _set_slice(_SLICE_NS)
            _usage("forward-usage in")
            _mark(f"{name} in")
            _idle.clear()
            try:
                return fn(*args, **kwargs)
            finally:
                _idle.set()
                _mark(f"{name} out")
                _usage("forward-usage out")
        return used
    if name == "ControlLoop._drain_inbound" and _DEFER:
        def deferred(*args: Any, **kwargs: Any) -> Any:
            _idle.wait(0.02)  # probe: no message handled while the engine thread runs a forward
            _mark(f"{name} in")
            try:
                return fn(*args, **kwargs)
            finally:
                _mark(f"{name} out")
        return deferred

    if _DETAIL and (name.split(".")[0] in ("DecoderLayer", "LlamaModel") or name == "ModelRunner._prepare"):
        def detailed(*args: Any, **kwargs: Any) -> Any:
            _usage(f"{name} in")
            try:
                return fn(*args, **kwargs)
            finally:
                _usage(f"{name} out")
        return detailed

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _mark(f"{name} in")
        try:
            return fn(*args, **kwargs)
        finally:
            if out:
                _mark(f"{name} out")
    return wrapped


def _install(table: dict[str, dict[str, bool]]) -> None:
    for where, calls in table.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name, out in calls.items():
            setattr(cls, name, _wrap(f"{cls_name}.{name}", getattr(cls, name), out))


def _install_functions() -> None:
    from kvwire.router import dispatcher, relay

    for module, names in ((dispatcher, ("prefill_body", "decode_body")),):
        for name in names:
            setattr(module, name, _wrap(name, getattr(module, name), True))
    splicer = relay.FirstTokenSplicer
    raw = splicer.from_prefill.__func__  # type: ignore[attr-defined]
    splicer.from_prefill = classmethod(_wrap("FirstTokenSplicer.from_prefill", raw, True))  # type: ignore[method-assign]


def _install_hold_d() -> None:
    """Probe: D's call waits for P's answer (the same client request), at most 30 s."""
    import asyncio

    from kvwire.router import relay

    call = relay.Relay.call
    answered: dict[int, asyncio.Event] = {}

    async def held(self: Any, inst: Any, role: str, creq: Any, body: bytes, *, stream: bool) -> Any:
        event = answered.setdefault(id(creq), asyncio.Event())
        if role == "decode" and creq.stream:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), 30)
        try:
            return await call(self, inst, role, creq, body, stream=stream)
        finally:
            if role == "prefill":
                event.set()
                asyncio.get_running_loop().call_later(60, answered.pop, id(creq), None)

    relay.Relay.call = held


def _install_client() -> None:
    from kvwire.bench import serve

    post = serve.post_completion

    async def marked(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        result = await post(*args, **kwargs)
        if result.ttft_s is not None:
            first = start + result.ttft_s
            os.write(_fd, f"{start:.6f} client main send in\n{first:.6f} client main first in\n".encode())
        return result

    serve.post_completion = marked


if _dir:
    argv = sys.argv
    if "--role" in argv:
        _role = argv[argv.index("--role") + 1]
        _install(INSTANCE)
        if os.environ.get("FIRST_TOKEN_SPLIT_SWITCH_S"):  # probe: the instances' GIL switch interval
            sys.setswitchinterval(float(os.environ["FIRST_TOKEN_SPLIT_SWITCH_S"]))
    elif "router" in argv and "bench" not in argv:
        _role = "router"
        _install(ROUTER)
        _install_functions()
        if os.environ.get("FIRST_TOKEN_SPLIT_HOLD_D"):
            _install_hold_d()
    elif "bench" in argv:
        _role = "client"
        _install_client()
    if _role:
        path = os.path.join(_dir, f"{_role}-{os.getpid()}.log")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
