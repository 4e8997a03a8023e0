"""The tensor-parallel group of one engine's processes: the all-reduce of the model's row-parallel
layers. Its own process group object (gloo on the CPU, NCCL on CUDA) over its own TCP store, not
torch.distributed's process-wide default group: two engines may live in one process (P and D in a
test) and each has a group of its own. Step messages travel over pipes (workers.py), not here."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from kvwire.errors import EngineError, RankLost


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the CPU for every rank, or ``cuda:(base + rank)``."""
    if device == "cpu":
        return "cpu"
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def create_store(timeout_s: float, host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of ``host`` (read ``.port``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)


class TPGroup:
    """This rank's membership. ``all_reduce`` sums a tensor over the ranks in place and fails after
    the timeout when a rank is lost, instead of waiting for it forever."""

    def __init__(self, rank: int, size: int, port: int, device: str, timeout_s: float,
                 store: dist.TCPStore | None = None) -> None:  # fmt: skip
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size = rank, size
        try:
            if store is None:
                store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
            self._store = store
            if device.startswith("cuda"):
                torch.cuda.set_device(torch.device(device))
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._pg: Any = dist.ProcessGroupNCCL(store, rank, size, options)
            else:
                self._pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"tensor-parallel rank {rank}/{size}: the group did not form: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """RankLost when a peer is gone (its socket closed, or no answer within the timeout)."""
        try:
            self._pg.allreduce([tensor]).wait()
        except RuntimeError as exc:
            where = f"rank {self.rank} of {self.size}"
            raise RankLost(f"tensor-parallel all-reduce on {where} failed: {exc}") from exc
        return tensor
