"""The tensor-parallel group of processes (torch.distributed default group): the all-reduce of the
model's row-parallel layers. Step messages travel over pipes (tp/workers.py), not through it."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from kvwire.errors import EngineError


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` (the rendezvous of the group's TCP store)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the CPU for every rank, or ``cuda:(base + rank)``."""
    if device == "cpu":
        return "cpu"
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of the default group, in place (the model's row-parallel
    outputs). Fails after the group's timeout when a rank is lost instead of waiting forever."""
    dist.all_reduce(tensor)
    return tensor


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def join_group(rank: int, size: int, init_method: str, device: str, timeout_s: float) -> None:
    """Join (rank 0: create) the default group; every collective afterwards fails after
    ``timeout_s`` instead of waiting for a lost rank forever. Raises EngineError when it does not form."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    try:
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        raise EngineError(f"tensor-parallel rank {rank}/{size}: the group did not form: {exc}") from exc
