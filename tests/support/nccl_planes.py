"""GPU test helpers: the plane driver (two NCCL planes in two processes without the agent, shared
with the plane-level benchmark row and living in :mod:`kvwire.transfer.planes.nccl.driver`) plus
what only tests need (GPU counts, waiting for a killed process and its GPU context)."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.transfer.memory import PeerRef, SendItem
from kvwire.transfer.planes.nccl.driver import (
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
from kvwire.transfer.planes.nccl.plane import NcclPlane

log = logging.getLogger(__name__)

__all__ = [
    "NCCL_SAFE_ENV",
    "Recorder",
    "child_results",
    "peer_ref",
    "post_layers",
    "run_in_child",
    "send_layers",
    "set_safe_env",
    "start_plane",
    "two_gpus",
    "wait_gpu_released",
    "wait_process_gone",
    "zero_copy_slab",
]


def two_gpus() -> bool:
    try:
        return torch.cuda.device_count() >= 2
    except Exception:  # a broken CUDA setup counts as "no GPUs", but say why
        log.warning("cannot count CUDA devices", exc_info=True)
        return False


def wait_process_gone(pid: int, timeout_s: float = 30.0) -> None:
    """Wait until process ``pid`` has exited (gone or a zombie: its CUDA context is torn down, so
    receives it had posted can no longer take data). Raises TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)  # polling an observable condition, under a deadline
    raise TimeoutError(f"process {pid} still running after {timeout_s} s")


def wait_gpu_released(pid: int, timeout_s: float = 30.0) -> bool:
    """Wait until process ``pid`` no longer holds a CUDA context on any GPU (``nvidia-smi``'s compute
    processes): a process can be gone while the driver still runs its last kernels, e.g. NCCL
    receives it had posted, which then still take a sender's data. False when ``nvidia-smi`` is not
    there (the caller then has only :func:`wait_process_gone`); TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(query, capture_output=True, text=True, timeout=10.0, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return False
        if str(pid) not in {line.strip() for line in out.splitlines()}:
            return True
        time.sleep(0.05)  # polling an observable condition, under a deadline
    raise TimeoutError(f"process {pid} still holds a GPU context after {timeout_s} s")


def send_layers(
    plane: NcclPlane,
    peer: PeerRef,
    transfer_id: str,
    tensors: Sequence[torch.Tensor],
    ready: Sequence[Any | None] | None = None,
    first_layer: int = 0,
) -> None:
    events = ready if ready is not None else [None] * len(tensors)
    plane.send(
        peer,
        [
            SendItem(transfer_id, first_layer + i, t, e)
            for i, (t, e) in enumerate(zip(tensors, events, strict=True))
        ],
    )
