"""The Ray actor that hosts one kvwire process (``kvwire serve`` or ``kvwire router``) on its node.

The actor supervises a child process rather than serving in its own (decision 120): the child is the
same ``kvwire serve`` / ``kvwire router`` as everywhere else (signals, drain, shutdown, TP ranks), and
the actor stays a thin Ray handle. Its life follows the child's both ways:

* the child dies unexpectedly (``kill -9``, a crash, a lost TP rank) -> a watcher thread ends the
  actor's process (``os._exit``), and Ray restarts the actor, which starts a new child under the same
  instance id (it registers again; the router replaces the old registration);
* the actor's process dies (``kill -9``, ``ray stop``, its owner gone) -> the kernel kills the child
  (``PR_SET_PDEATHSIG``, set by :class:`~kvwire.cluster.process.ManagedProcess`; the child is started
  from the actor's main thread, where Ray runs the methods of a synchronous actor).

``drain`` (removal) and ``stop`` (teardown) end the child on purpose: the watcher then lets it go.
Child output goes to the actor's stdout, which Ray forwards to the driver with the actor's name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from kvwire.cluster.process import ManagedProcess
from kvwire.supervision import guarded

log = logging.getLogger(__name__)
EXIT_CHILD_DIED = 3  # the actor's exit code when its child died unexpectedly (Ray restarts it)


def node_ip() -> str:
    """This node's address as Ray knows it (what the processes here bind and advertise)."""
    return str(ray.util.get_node_ip_address())


class ProcessHost:
    """See the module docstring. ``argv`` runs the child; ``host_flags`` are flags that receive this
    node's IP (appended as ``FLAG IP``, since the node is known only once placed); ``env`` is added
    to the actor's environment (secrets travel there, never on a command line)."""

    def __init__(self, name: str, argv: Sequence[str], host_flags: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.ip = node_ip()
        self.restarted = _was_restarted()
        full = [*argv, *(part for flag in host_flags for part in (flag, self.ip))]
        self._stopping = False
        self._lock = threading.Lock()
        self.proc = ManagedProcess(name, full, sink=sys.stdout, sink_lock=self._lock,
                                   env=dict(os.environ, **(env or {})))
        watcher = threading.Thread(target=guarded(f"watch-{name}", self._watch), name=f"watch-{name}",
                                   daemon=True)
        watcher.start()

    def _watch(self) -> None:
        code = self.proc.proc.wait()
        if self._stopping:
            return
        print(f"[{self.name}] exited with code {code}; the actor exits so that Ray restarts it", flush=True)
        os._exit(EXIT_CHILD_DIED)

    def info(self) -> dict[str, Any]:
        """Where it runs: node id and IP, the actor's and the child's pids, and whether Ray restarted
        this actor (a new child after a death)."""
        return {"name": self.name, "node_id": ray.get_runtime_context().get_node_id(), "ip": self.ip,
                "actor_pid": os.getpid(), "pid": self.proc.pid, "alive": self.proc.poll() is None,
                "restarted": self.restarted}

    def drain(self, timeout_s: float, grace_s: float) -> int | None:
        """SIGUSR1 to the child (``kvwire serve`` drains: deregisters, finishes what is in flight,
        stops), wait up to ``timeout_s + grace_s``, then SIGKILL what is left. Returns its exit code."""
        self._stopping = True
        self.proc.signal(signal.SIGUSR1)
        code = self.proc.wait_exit(timeout_s + grace_s)
        if code is None:
            log.warning("%s did not drain within %.1f s: killing it", self.name, timeout_s + grace_s)
        self.proc.stop(grace_s)
        return self.proc.poll()

    def stop(self, grace_s: float) -> int:
        """SIGTERM the child's process group, SIGKILL after ``grace_s``. Returns its exit code."""
        self._stopping = True
        return self.proc.stop(grace_s)


def _was_restarted() -> bool:
    """Whether Ray restarted the current actor (its own API for it warns that the state call behind
    it is deprecated; the answer is still right, asked once per actor start)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def free_ports(count: int) -> tuple[str, list[int]]:
    """This node's IP and ``count`` ports free on it now (run as a task in a placement group, so
    that it runs on the node the router will run on; a small race with other binders is accepted,
    as in :func:`kvwire.cluster.local.free_port`)."""
    ip = node_ip()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((ip, 0))
        return ip, [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
