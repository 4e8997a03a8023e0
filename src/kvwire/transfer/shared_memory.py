"""CPU tensors in shared memory (memfd), so that a peer process on the same host can map them.

Why: the shared-memory data plane writes a sender's KV blocks straight into the receiver's blocks
when those blocks live in memory the sender can map (one copy per byte instead of two through the
staging ring; docs/decisions/080-shm-one-copy.md). The built-in engine allocates its CPU KV cache
here; anything else (vLLM's caches, receive and spill buffers) stays ordinary memory and moves
through the ring.

A :class:`SharedRegion` is one ``memfd`` (an anonymous file: no name in ``/dev/shm``, nothing to
leak on ``kill -9``) mapped into this process. Its descriptor stays open while any tensor views the
region so the plane can pass it to peers (``SCM_RIGHTS``); it closes with the last such tensor.
Tensors made here behave as any CPU tensor (pages are zero until first written, as with
``torch.zeros``, but touched lazily).

Thread-safe: the registry is guarded by a lock.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import itertools
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch

MEMFD_NAME = "kvwire-kv"  # shows in /proc/<pid>/maps as "/memfd:kvwire-kv (deleted)"
_ALIGN = 4096  # each tensor of an arena starts on its own page


@dataclasses.dataclass(frozen=True)
class SharedRegion:
    """One memfd mapped into this process: ``address`` is the mapping's base, ``fd`` its descriptor
    (owned by the registry: do not close; duplicate it to keep it past the region's life)."""

    region_id: int
    fd: int
    size: int
    address: int


def sealed_memfd(name: str, num_bytes: int) -> int:
    """A new memfd of ``num_bytes`` whose size can never change (sealed: a process that maps it
    cannot be made to fault on pages cut away under it, SIGBUS). Caller owns the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, num_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_peer_memfd(fd: int, num_bytes: int) -> None:
    """Raises ValueError unless ``fd`` (received from a peer) holds ``num_bytes`` and is sealed
    against shrinking, so mapping and writing all of it is safe."""
    size = os.fstat(fd).st_size
    if size != num_bytes:
        raise ValueError(f"peer memory descriptor holds {size} bytes, announced {num_bytes}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError(f"peer memory descriptor is not a sealable memfd: {exc}") from exc
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError("peer memory descriptor is not sealed against shrinking")


class GcSafeLock:
    """A lock that garbage-collector finalizers also need. A finalizer runs when the collector frees
    an object, which any allocation may trigger, also while this very thread holds the lock: taking
    it again there would deadlock. :meth:`finalizer` runs its work under the lock at once, or, when
    its thread is inside :meth:`held` already, when that section ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._deferred: list[tuple[Callable[..., None], tuple[object, ...]]] = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._local.busy = True
            try:
                yield
            finally:
                self._local.busy = False
        while self._deferred:
            fn, args = self._deferred.pop()
            self.finalizer(fn, *args)

    def finalizer(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` with the lock held (now, or once this thread's section ends)."""
        if getattr(self._local, "busy", False):
            self._deferred.append((fn, args))
            return
        with self.held():
            fn(*args)


_lock = GcSafeLock()
_regions: dict[int, SharedRegion] = {}
_ids = itertools.count(1)


def _forget(region_id: int) -> None:
    region = _regions.pop(region_id, None)
    if region is not None:
        os.close(region.fd)


def _release(region_id: int) -> None:
    """Forget a region and close its descriptor (once: a region closed early is no longer listed)."""
    _lock.finalizer(_forget, region_id)


def _new_region(num_bytes: int) -> tuple[SharedRegion, npt.NDArray[np.uint8]]:
    """A new region and a ``uint8`` array over all of it. Tensors and arrays made from that array
    keep it alive; the region's descriptor closes when it goes. The mapping itself holds no
    descriptor (``torch.from_file`` closes its own), so a region costs one open file."""
    fd = sealed_memfd(MEMFD_NAME, num_bytes)
    try:
        base = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=num_bytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    array: npt.NDArray[np.uint8] = base.numpy()
    region = SharedRegion(next(_ids), fd, num_bytes, base.data_ptr())
    with _lock.held():
        _regions[region.region_id] = region
    weakref.finalize(array, _release, region.region_id)
    return region, array


def shared_tensors(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero-filled contiguous CPU tensors of ``shapes``, all carved out of one new memfd (one
    region, so a peer maps one descriptor for a whole KV cache)."""
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * item for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    if total == 0:
        return [torch.zeros(tuple(shape), dtype=dtype) for shape in shapes]
    _, array = _new_region(total)
    flat = torch.from_numpy(array)  # the tensors below keep ``array`` (and the region) alive
    return [
        flat[off : off + size].view(dtype).view(tuple(shape))
        for off, size, shape in zip(offsets, sizes, shapes, strict=True)
    ]


def shared_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """One zero-filled CPU tensor in a new shared region."""
    return shared_tensors([shape], dtype)[0]


def region_of(tensor: torch.Tensor) -> tuple[SharedRegion, int] | None:
    """The shared region holding all of ``tensor``'s bytes and the offset of its first byte in it;
    None for a tensor that is not (entirely) in one (e.g. ordinary CPU memory, GPU memory)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock.held():
        for region in _regions.values():
            if region.address <= start and end <= region.address + region.size:
                return region, start - region.address
    return None


def live_regions() -> list[SharedRegion]:
    """Every region alive in this process (tests and diagnostics)."""
    with _lock.held():
        return list(_regions.values())


class SharedArena:
    """One shared region that hands out flat ``uint8`` buffers (first fit over a free list that
    merges neighbours; page-aligned). A buffer's range returns to the arena when the last tensor
    viewing it is gone. Pages are touched lazily: an arena costs memory only where it was used.
    Thread-safe."""

    def __init__(self, num_bytes: int) -> None:
        self.size = -(-num_bytes // _ALIGN) * _ALIGN
        self.region, self._array = _new_region(self.size)
        self._lock = GcSafeLock()
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, bytes), sorted by offset

    def allocate(self, num_bytes: int) -> torch.Tensor | None:
        """A buffer of ``num_bytes`` in the arena, or None when no free range is large enough."""
        size = max(_ALIGN, -(-num_bytes // _ALIGN) * _ALIGN)
        with self._lock.held():
            for i, (off, n) in enumerate(self._free):
                if n >= size:
                    if n == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, n - size)
                    break
            else:
                return None
        view = self._array[off : off + num_bytes]
        weakref.finalize(view, self._lock.finalizer, self._free_range, off, size)  # from_numpy holds it
        return torch.from_numpy(view)

    def _free_range(self, offset: int, size: int) -> None:
        """Return a buffer's range to the free list (the lock held)."""
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:  # merge right
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge left
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free.pop(i)[1])

    def close(self) -> None:
        """No more exports (the owner closes): the region's descriptor closes now; buffers still
        held keep their memory until they go."""
        _release(self.region.region_id)

    def free_bytes(self) -> int:
        with self._lock.held():
            return sum(n for _, n in self._free)
