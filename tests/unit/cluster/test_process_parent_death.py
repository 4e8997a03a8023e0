"""A cluster's children die with their parent, even when the parent is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from kvwire.cluster.process import wait_until

PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from kvwire.cluster.process import ManagedProcess
    child = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"],
                           sink=sys.stderr, sink_lock=threading.Lock())
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as dead
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_child_dies_when_the_parent_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_until(lambda: not _alive(child_pid), timeout_s=10), "child outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)
