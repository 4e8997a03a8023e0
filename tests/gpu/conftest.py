"""GPU test plumbing: scenario functions run in spawned processes (one per GPU) and report through a
queue; the ``spawn`` fixture kills whatever is still alive at the end of the test."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    from support.nccl_planes import run_in_child

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs: list[Any] = []

    def start(fn: Callable[..., Any], rank: int, conn: Connection, arg: Any = None) -> Any:
        proc = ctx.Process(target=run_in_child, args=(fn, rank, conn, queue, arg), daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    start.queue = queue  # type: ignore[attr-defined]
    start.ctx = ctx  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        proc.join(timeout=10)
        if proc.exitcode not in (None, 0):
            print(f"GPU test child {proc.name} exited with {proc.exitcode}", file=sys.stderr)
        if proc.is_alive():  # hung: its threads' stacks to stderr first (run_in_child), then kill
            os.kill(proc.pid, signal.SIGUSR1)
            proc.join(timeout=3)
            proc.kill()
            proc.join(timeout=5)
