"""The shared-memory plane's pieces without threads: the memfd ring and copies to/from byte spans.

The ring is a ``memfd`` (an anonymous file: it has no name anywhere, so nothing can leak when a
process is killed; the kernel frees it when the last process that maps it exits or unmaps it). The
receiver creates it and passes the descriptor to the sender over their Unix socket (SCM_RIGHTS).

Copies go through :func:`~kvwire.transfer.planes.shm.run_copy.copy_runs`: one ``memcpy`` per byte
run, a chunk's runs in one call without the GIL (native copier), so the sender's gather and the
receiver's scatter (other processes, or other threads of one process) overlap.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvwire.transfer.memory import check_peer_memfd, sealed_memfd
from kvwire.transfer.planes.shm.run_copy import copy_runs, run_table

Bytes = npt.NDArray[np.uint8]


def create_ring(num_bytes: int) -> tuple[int, mmap.mmap]:
    """A new memfd of ``num_bytes`` (sealed: its size never changes) and this process's mapping of
    it (close the fd once sent)."""
    fd = sealed_memfd("kvwire-shm-ring", num_bytes)
    try:
        return fd, mmap.mmap(fd, num_bytes)
    except BaseException:
        os.close(fd)
        raise


def map_ring(fd: int, num_bytes: int) -> mmap.mmap:
    """Map a ring received from the peer; closes ``fd`` (the mapping keeps the memory)."""
    try:
        check_peer_memfd(fd, num_bytes)
        return mmap.mmap(fd, num_bytes)
    finally:
        os.close(fd)


def ring_array(ring: mmap.mmap) -> Bytes:
    return np.frombuffer(ring, dtype=np.uint8)


def tensor_array(tensor: torch.Tensor) -> Bytes:
    """Zero-copy writable ``uint8`` array over a contiguous CPU tensor's bytes (any dtype)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class SpanCursor:
    """Walks one layer's byte runs (``spans`` of ``base``) in order: ``gather`` copies the next
    bytes out into the ring, ``scatter`` copies ring bytes into the next runs. ``pos`` counts the
    layer bytes done. Adjacent runs are merged first (fewer, longer copies)."""

    def __init__(self, base: Bytes, spans: Sequence[tuple[int, int]]) -> None:
        self.base = base
        self.spans = coalesce(spans)
        self.total = sum(n for _, n in self.spans)
        self.pos = 0
        self._index = 0  # current run
        self._within = 0  # bytes of the current run already done

    def remaining(self) -> int:
        return self.total - self.pos

    def gather(self, ring: Bytes, at: int, num_bytes: int) -> None:
        """Copy the next ``num_bytes`` layer bytes into ``ring[at:at + num_bytes]``."""
        runs = self._walk(num_bytes)
        copy_runs(self.base, ring, run_table([(off, at + within, n) for off, n, within in runs]))

    def scatter(self, ring: Bytes, at: int, num_bytes: int) -> None:
        """Copy ``ring[at:at + num_bytes]`` into the next ``num_bytes`` layer bytes."""
        runs = self._walk(num_bytes)
        copy_runs(ring, self.base, run_table([(at + within, off, n) for off, n, within in runs]))

    def _walk(self, num_bytes: int) -> list[tuple[int, int, int]]:
        """(base offset, length, offset within the chunk) of the next ``num_bytes``; advances."""
        if num_bytes > self.remaining():
            raise ValueError(f"{num_bytes} bytes past the layer's end ({self.remaining()} left)")
        out = []
        done = 0
        while done < num_bytes:
            off, n = self.spans[self._index]
            take = min(n - self._within, num_bytes - done)
            out.append((off + self._within, take, done))
            done += take
            self._within += take
            if self._within == n:
                self._index += 1
                self._within = 0
        self.pos += num_bytes
        return out


def coalesce(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge runs that continue each other (order kept, empty runs dropped)."""
    out: list[tuple[int, int]] = []
    for off, n in spans:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def next_slot(head: int, num_bytes: int, size: int) -> int:
    """Ring position where ``num_bytes`` go when the writer is at ``head``: a chunk never wraps,
    so it skips to the next lap when the bytes left before the ring's end are too few."""
    offset = head % size
    return head if offset + num_bytes <= size else head + (size - offset)
