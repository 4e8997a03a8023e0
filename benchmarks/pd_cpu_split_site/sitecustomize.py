"""Native thread names for ``benchmarks/pd_cpu_split.py`` only.

Loaded by every process started with this directory first on ``PYTHONPATH``. With ``PD_CPU_SPLIT``
set it gives each Python thread's OS thread its Python name (``prctl(PR_SET_NAME)``, 15 bytes), so
that the driver can add up ``/proc/<pid>/task/<tid>`` CPU clocks by thread name. Nothing else.
"""

from __future__ import annotations

import ctypes
import os
import threading

PR_SET_NAME = 15

if os.environ.get("PD_CPU_SPLIT"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None

    def _name_this(name: str) -> None:
        if _prctl is not None:
            _prctl(PR_SET_NAME, name.encode("utf-8", "replace")[:15], 0, 0, 0)

    _inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def _bootstrap_inner(self: threading.Thread) -> None:
        _name_this(self.name)
        _inner(self)

    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
    _name_this("main")

if os.environ.get("PD_CPU_SPLIT_MESSAGES"):  # count the transfer agent's control messages by type
    import atexit
    import collections
    import json

    from kvwire.transfer import agent as _agent
    from kvwire.transfer import core as _core

    _counts: collections.Counter[str] = collections.Counter()
    _send_now, _on_message = _agent.ControlLoop._send_now, _core.Routes.on_message

    def _counted_send(self: object, endpoint: str, msg: object) -> None:
        _counts["sent " + type(msg).__name__] += 1
        _send_now(self, endpoint, msg)  # type: ignore[arg-type]

    def _counted_receive(self: object, msg: object) -> None:
        _counts["received " + type(msg).__name__] += 1
        _on_message(self, msg)  # type: ignore[arg-type]

    _agent.ControlLoop._send_now = _counted_send  # type: ignore[method-assign]
    _core.Routes.on_message = _counted_receive  # type: ignore[method-assign]

    def _dump() -> None:
        path = os.path.join(os.environ["PD_CPU_SPLIT_MESSAGES"], f"messages-{os.getpid()}.json")
        with open(path, "w") as out:
            json.dump(dict(_counts), out)

    atexit.register(_dump)
