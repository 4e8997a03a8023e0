"""Drive two :class:`~kvwire.transfer.planes.nccl.plane.NcclPlane` s in two processes without the agent.

Used by the NCCL benchmark and the GPU tests: it plays the agent's part of the plane contract
(post receive buffers, carry ``local_info`` bytes to the peer's ``on_peer_info`` with the "grant",
hand ready layers to ``send``) over a ``multiprocessing`` pipe, and records the plane's callbacks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import torch

from kvwire.transfer.planes.nccl.bindings import CommConfig, NcclComm, load_nccl
from kvwire.transfer.planes.nccl.config import NcclPlaneConfig
from kvwire.transfer.planes.nccl.driver import (  # re-exported: the bench drives the plane too
    NCCL_SAFE_ENV,
    Recorder,
    child_results,
    peer_ref,
    post_layers,
    run_in_child,
    set_safe_env,
    start_plane,
    zero_copy_slab,
)

log = logging.getLogger(__name__)





_profiling = False  # inside profiled(): markers are recorded


@contextlib.contextmanager
def profiled(directory: str | None, label: str, rank: int) -> Iterator[None]:
    """Record the block's CPU and GPU timeline (torch.profiler, CUPTI) into
    ``directory/label-r{rank}.json`` (a Chrome trace; ``benchmarks/timeline.py`` prints both ranks'
    GPU work on one time axis). A no-op without ``directory``. Enter and leave it only while nothing
    is posted or armed: the profiler may synchronize the device."""
    if not directory:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    global _profiling
    os.makedirs(directory, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _profiling = True
        try:
            yield
        finally:
            _profiling = False
    prof.export_chrome_trace(os.path.join(directory, f"{label}-r{rank}.json"))


def save_host_samples(directory: str, label: str, rank: int, samples: Sequence[float]) -> None:
    """Rank 0: the traced iterations' host-measured seconds, as us in ``directory/label-host.json``
    (benchmarks/timeline.py prints them beside each iteration's GPU span)."""
    if rank == 0:
        with open(os.path.join(directory, f"{label}-host.json"), "w") as fh:
            json.dump([round(x * 1e6, 1) for x in samples], fh)


def marker(name: str) -> contextlib.AbstractContextManager[object]:
    """A named host-side span in the trace while :func:`profiled` records, else nothing."""
    return torch.profiler.record_function(name) if _profiling else contextlib.nullcontext()
























def raw_comm(
    conn: Connection, rank: int, config: CommConfig | None = None, timeout_s: float = 60.0
) -> NcclComm:
    """A plain two-rank communicator between the two harness processes (rank 0 makes the id)."""
    if rank == 0:
        uid = load_nccl().unique_id()
        conn.send(uid)
    else:
        uid = conn.recv()
    return NcclComm.create(uid, rank, 2, config or CommConfig(blocking=True), time.monotonic() + timeout_s)


def wait_stream(stream: torch.cuda.Stream, comm: NcclComm | None = None) -> None:
    """Wait for ``stream`` with a blocking event synchronize (microsecond wake-up; a sleep-poll adds
    ~60 us). A hang is bounded by the caller's process timeout (the benchmark and the GPU tests kill
    their children), not here: a timer thread per wait would cost more than the wait on small layers."""
    del comm
    event = torch.cuda.Event()
    event.record(stream)
    event.synchronize()


__all__ = [
    "NCCL_SAFE_ENV",
    "NcclPlaneConfig",
    "Recorder",
    "child_results",
    "marker",
    "peer_ref",
    "post_layers",
    "profiled",
    "raw_comm",
    "run_in_child",
    "save_host_samples",
    "set_safe_env",
    "start_plane",
    "wait_stream",
    "zero_copy_slab",
]
