"""One child process of a local cluster: own process group, prefixed log lines, bounded stop.

Each child runs in a new session (its own process group), so stopping it reaches every process it
started (e.g. engine helpers) and a Ctrl-C in the terminal goes to the cluster manager only, which
then stops children in order. Stop = SIGTERM to the group, wait ``grace_s``, then SIGKILL the group.

A child also dies with its parent, even when the parent is killed with SIGKILL and cannot stop it:
on Linux it asks the kernel for ``PR_SET_PDEATHSIG`` = SIGKILL before it runs the command. The
kernel sends that signal when the *thread* that started the child exits, so start children from a
thread that lives as long as the cluster (the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

logger = logging.getLogger(__name__)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def preexec() -> None:  # runs in the child between fork and exec: no allocation-heavy work
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class ManagedProcess:
    """A subprocess whose output lines are copied to ``sink`` as ``[name] line``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        sink: TextIO,
        sink_lock: threading.Lock,
        env: dict[str, str] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self._sink = sink
        self._sink_lock = sink_lock
        self.lines: list[str] = []  # every output line (tests and start-up errors read it)
        self.expected_exit = False  # set when the cluster kills it on purpose (fault injection)
        self._lines_lock = threading.Lock()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()) if die_with_parent else None,
            env=env,
            text=True,
            errors="replace",  # a child's stray bytes must not end the log pump (its pipe would fill)
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._pump, name=f"log-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            text = line.rstrip("\n")
            with self._lines_lock:
                self.lines.append(text)
            with self._sink_lock:
                try:
                    self._sink.write(f"[{self.name}] {text}\n")
                    self._sink.flush()
                except (ValueError, OSError):
                    pass  # the sink was closed (shutdown): keep draining the pipe

    def output(self) -> str:
        with self._lines_lock:
            return "\n".join(self.lines)

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (no-op once it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float) -> int:
        """SIGTERM the group, wait up to ``grace_s``, then SIGKILL it. Returns the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.1f s: killing it", self.name, grace_s)
        self.signal(signal.SIGKILL)  # helpers left in the group, if any
        code = self.proc.wait(timeout=grace_s)
        self._reader.join(timeout=grace_s)
        return code

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None


def kvwire_argv(*args: str) -> list[str]:
    """argv running the ``kvwire`` CLI with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "kvwire.cli", *args]


def wait_until(condition: Callable[[], object], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``condition()`` until true or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
