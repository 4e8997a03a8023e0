"""Receive memory: a byte budget on the agent's device plus a bounded, lazily allocated spill pool.

The agent reserves a :class:`RecvBuffer` for every layer before granting credit for it, so received
bytes always have a place to land; when neither the budget nor the spill pool can hold a layer the
agent simply grants no more credit and the sender waits (within its deadline).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import threading
from collections.abc import Callable

import torch


class BufferKind(str, enum.Enum):
    BUDGET = "budget"  # device memory (the plane's allocate), within recv_budget_bytes
    SPILL = "spill"  # host memory from the spill pool (pinned when the device is CUDA)


@dataclasses.dataclass
class RecvBuffer:
    """A flat ``uint8`` buffer of ``num_bytes`` reserved for one layer. Release exactly once."""

    tensor: torch.Tensor
    num_bytes: int
    kind: BufferKind
    _release: Callable[[RecvBuffer, bool], None]
    released: bool = False

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The layer as ``shape``/``dtype`` (no copy)."""
        return self.tensor[: self.num_bytes].view(dtype).view(shape)

    def release(self) -> None:
        """Return the memory to its pool (it may be reused at once)."""
        if not self.released:
            self.released = True
            self._release(self, True)

    def hand_over(self) -> None:
        """Stop accounting for the memory without reusing it: the caller keeps the tensor."""
        if not self.released:
            self.released = True
            self._release(self, False)


class BufferPool:
    """Flat ``uint8`` buffers up to ``capacity_bytes``, allocated on first use and reused (best fit).

    Thread-safe. Freed buffers stay cached for reuse (no page faults / pinning on the hot path);
    cached-but-free bytes count toward the capacity and are dropped when a new allocation would
    otherwise exceed it. A reused buffer may be larger than asked (at most 2x).
    """

    def __init__(self, capacity_bytes: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self.capacity_bytes = capacity_bytes
        self._allocate = allocate
        self._lock = threading.Lock()
        self._in_use_bytes = 0
        self._free: list[tuple[int, int, torch.Tensor]] = []  # (size, seq, tensor), sorted by size
        self._free_bytes = 0
        self._seq = 0

    @property
    def in_use_bytes(self) -> int:
        with self._lock:
            return self._in_use_bytes

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    def try_alloc(self, num_bytes: int) -> torch.Tensor | None:
        """A buffer of at least ``num_bytes`` or None when the pool is full."""
        with self._lock:
            if self._in_use_bytes + num_bytes > self.capacity_bytes:
                return None
            i = bisect.bisect_left(self._free, (num_bytes, -1))
            if (
                i < len(self._free)
                and self._free[i][0] <= 2 * num_bytes + 4096
                and self._in_use_bytes + self._free[i][0] <= self.capacity_bytes
            ):
                size, _, tensor = self._free.pop(i)
                self._free_bytes -= size
                self._in_use_bytes += size
                return tensor
            while self._free and self._in_use_bytes + self._free_bytes + num_bytes > self.capacity_bytes:
                size, _, _ = self._free.pop()  # drop the largest cached buffer
                self._free_bytes -= size
            self._in_use_bytes += num_bytes
        try:  # allocate outside the lock: pinning can take milliseconds
            return self._allocate(num_bytes)
        except BaseException:
            with self._lock:
                self._in_use_bytes -= num_bytes
            raise

    def free(self, tensor: torch.Tensor, reuse: bool = True) -> None:
        size = int(tensor.numel())
        with self._lock:
            self._in_use_bytes -= size
            if not reuse:
                return
            self._seq += 1
            bisect.insort(self._free, (size, self._seq, tensor))
            self._free_bytes += size


class RecvMemory:
    """Receive budget (device, via the plane's ``allocate``) + spill pool (host). Thread-safe."""

    def __init__(
        self, budget_bytes: int, spill_bytes: int, allocate: Callable[[int], torch.Tensor], pinned: bool
    ) -> None:
        self.budget = BufferPool(budget_bytes, allocate)
        self.spill = BufferPool(spill_bytes, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned))
        # the most a transfer's layers may take (read per granted layer: a field, not a property)
        self.capacity_bytes = budget_bytes + spill_bytes
        # the largest buffer reserve() can ever give: one layer lands in one pool, so a larger layer
        # never gets credit, however much of both pools is free (read per granted layer: a field)
        self.largest_buffer_bytes = max(budget_bytes, spill_bytes)

    @property
    def budget_in_use(self) -> int:
        return self.budget.in_use_bytes

    def reserve(self, num_bytes: int) -> RecvBuffer | None:
        """A buffer from the budget, else from the spill pool, else None (no credit now)."""
        tensor = self.budget.try_alloc(num_bytes)
        if tensor is not None:
            return RecvBuffer(tensor, num_bytes, BufferKind.BUDGET, self._release)
        tensor = self.spill.try_alloc(num_bytes)
        if tensor is None:
            return None
        return RecvBuffer(tensor, num_bytes, BufferKind.SPILL, self._release)

    def _release(self, buf: RecvBuffer, reuse: bool) -> None:
        pool = self.budget if buf.kind is BufferKind.BUDGET else self.spill
        pool.free(buf.tensor, reuse)
