"""GPU memory that NCCL can register for zero-copy point-to-point (``ncclMemAlloc``), as a torch tensor.

NCCL moves a send/recv between two GPUs of one host through a FIFO in the receiver's memory, which
the receiving kernel then copies into the user's buffer: every byte crosses the receiver's HBM three
times. When *both* ends pass buffers registered with their communicator (``ncclCommRegister``), the
sender writes into the receiver's buffer directly. Registration needs memory NCCL can export to the
peer process: ``ncclMemAlloc`` (cuMem with a shareable handle) always qualifies; the caching
allocator's ``cudaMalloc`` memory only with ``NCCL_LEGACY_CUDA_REGISTER=1``, which we do not set
(it is process-wide and would change how every other NCCL user of the process registers).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
from typing import Any

import torch

from kvwire.errors import TransferError
from kvwire.transfer.planes.nccl.bindings import NcclUnavailableError, load_nccl, run_together

log = logging.getLogger(__name__)


class _DeviceMemory:
    """Exposes one raw allocation through ``__cuda_array_interface__`` (what ``torch.as_tensor`` reads)."""

    def __init__(self, ptr: int, num_bytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


class NcclBuffer:
    """``num_bytes`` of ``ncclMemAlloc`` memory on the current CUDA device, as :attr:`tensor` (uint8).

    The memory is freed by :meth:`close` (idempotent); views of :attr:`tensor` must not be used
    after it, and nothing may still be reading or writing it on any stream (callers synchronize or
    wait for their events first)."""

    def __init__(self, num_bytes: int) -> None:
        if num_bytes <= 0:
            raise ValueError("NcclBuffer needs a positive size")
        lib = load_nccl()
        if not lib.has_registration:
            raise NcclUnavailableError("this libnccl has no ncclMemAlloc (needs >= 2.19)")
        self._lib = lib
        ptr = ctypes.c_void_p()
        lib.check(lib.raw.ncclMemAlloc(ctypes.byref(ptr), num_bytes), "ncclMemAlloc")
        self.ptr = int(ptr.value or 0)
        self.num_bytes = num_bytes
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.tensor = torch.as_tensor(_DeviceMemory(self.ptr, num_bytes), device=self.device)
        self._lock = threading.Lock()
        self._freed = False

    def close(self) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._lib.check(self._lib.raw.ncclMemFree(ctypes.c_void_p(self.ptr)), "ncclMemFree")

    def __enter__(self) -> NcclBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_POOL_MIN_BYTES = 1 << 20


def pool_size(num_bytes: int) -> int:
    """Size class of a pooled staging buffer: the next power of two, at least 1 MiB."""
    size = _POOL_MIN_BYTES
    while size < num_bytes:
        size <<= 1
    return size


class ZeroCopyMemory:
    """The registrable memory of one NCCL plane (one GPU): slabs its users allocate
    (:meth:`allocate`) and a pool of staging buffers for messages whose own memory is not registrable
    (:meth:`take` / :meth:`give`). Each buffer is registered with a communicator the first time that
    communicator moves it (:meth:`register`), and deregistered from every live one before it is freed.
    Pooled buffers are kept until :meth:`close` (the pool holds at most what was in flight at once).
    Thread-safe."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._buffers: dict[int, NcclBuffer] = {}  # start address -> buffer (slabs and pooled)
        self._starts: list[int] = []  # sorted start addresses
        self._free: dict[int, list[NcclBuffer]] = {}  # size class -> idle pooled buffers
        self._registered: dict[int, dict[int, tuple[Any, int]]] = {}  # start -> id(comm) -> (comm, handle)
        self._closed = False

    # --- slabs ----------------------------------------------------------------------------------------
    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``num_bytes`` that NCCL can move in place (kept until :meth:`release`
        or :meth:`close`)."""
        return self._new(num_bytes).tensor

    def release(self, tensor: torch.Tensor) -> None:
        """Free a slab from :meth:`allocate` (deregistered from every communicator first). Nothing may
        still use it: its transfers are done and no stream reads or writes it."""
        with self._lock:
            buffer = self._buffers.pop(tensor.data_ptr(), None)
            if buffer is None:
                raise ValueError("release: not a slab of this plane (pass the tensor allocate returned)")
            self._starts.remove(buffer.ptr)
            registrations = self._registered.pop(buffer.ptr, {})
        for comm, handle in registrations.values():
            comm.deregister(handle)
        buffer.close()

    # --- staging pool -------------------------------------------------------------------------------
    def take(self, num_bytes: int) -> NcclBuffer:
        """A pooled buffer of at least ``num_bytes`` (its :attr:`~NcclBuffer.tensor` may be larger)."""
        size = pool_size(num_bytes)
        with self._lock:
            idle = self._free.get(size)
            if idle:
                return idle.pop()
        return self._new(size)

    def give(self, buffer: NcclBuffer) -> None:
        """Return a :meth:`take` buffer once no stream uses it any more."""
        with self._lock:
            if not self._closed:
                self._free.setdefault(buffer.num_bytes, []).append(buffer)

    # --- lookup and registration ------------------------------------------------------------------------
    def find(self, address: int, num_bytes: int) -> NcclBuffer | None:
        """The buffer that holds ``[address, address + num_bytes)`` entirely, if any."""
        with self._lock:
            index = bisect.bisect_right(self._starts, address) - 1
            if index < 0:
                return None
            buffer = self._buffers[self._starts[index]]
        return buffer if address + num_bytes <= buffer.ptr + buffer.num_bytes else None

    def register(self, comm: Any, buffer: NcclBuffer) -> None:
        """Register ``buffer`` with ``comm`` (a
        :class:`~kvwire.transfer.planes.nccl.bindings.NcclComm`) unless it is already. Called by the
        thread that drives ``comm``."""
        with self._lock:
            known = self._registered.setdefault(buffer.ptr, {})
            if id(comm) in known and known[id(comm)][0] is comm:
                return
        handle = comm.register(buffer.ptr, buffer.num_bytes)
        with self._lock:
            self._registered.setdefault(buffer.ptr, {})[id(comm)] = (comm, handle)

    def deregister_all(self, comm: Any, timeout_s: float = 2.0) -> bool:
        """Deregister every buffer registered with ``comm``, before it is aborted or destroyed (NCCL
        2.28 can crash in ``ncclCommAbort`` while it tears down IPC registrations itself). Each
        deregistration asks the peer to unmap the buffer; with a dead peer that fails (logged by
        NCCL, ignored here). Runs on a helper thread: past ``timeout_s`` (a peer that never answers)
        the caller goes on with the abort, which ends it. True when every call returned."""
        with self._lock:
            handles = []
            for known in self._registered.values():
                entry = known.pop(id(comm), None)
                if entry is not None and entry[0] is comm:
                    handles.append(entry[1])
        if not handles:
            return True

        def run() -> None:
            for handle in handles:
                try:
                    comm.deregister(handle)
                except TransferError as exc:  # the peer is gone: nothing left to unmap there
                    log.debug("deregistering a zero-copy buffer failed: %s", exc)

        return run_together([run], "kvwire-nccl-deregister", timeout_s)

    def forget(self, comm: Any) -> None:
        """``comm`` is gone (aborted or destroyed, which drops its registrations): stop tracking it."""
        with self._lock:
            for known in self._registered.values():
                entry = known.get(id(comm))
                if entry is not None and entry[0] is comm:
                    del known[id(comm)]

    def close(self) -> None:
        """Free every buffer (after every communicator that used them is closed)."""
        with self._lock:
            self._closed = True
            buffers = list(self._buffers.values())
            self._buffers.clear()
            self._starts.clear()
            self._free.clear()
            self._registered.clear()
        for buffer in buffers:
            buffer.close()

    @property
    def num_bytes(self) -> int:
        """GPU memory held (slabs and pooled staging)."""
        with self._lock:
            return sum(buffer.num_bytes for buffer in self._buffers.values())

    def _alloc(self, num_bytes: int) -> NcclBuffer:
        with torch.cuda.device(self.device):
            return NcclBuffer(num_bytes)

    def _new(self, num_bytes: int) -> NcclBuffer:
        buffer = self._alloc(num_bytes)
        with self._lock:
            if self._closed:
                buffer.close()
                raise TransferError("the NCCL plane is closed")
            self._buffers[buffer.ptr] = buffer
            bisect.insort(self._starts, buffer.ptr)
        return buffer
