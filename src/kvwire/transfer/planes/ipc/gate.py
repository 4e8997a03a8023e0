"""The IPC writer's launch gate: a batch's copies reach the GPU together, after the host enqueued all
of them.

Without it, an idle copy stream starts a batch's first event the moment it is recorded, and the host's
time to launch (Triton's runner, the GIL shared with the engine's threads) falls inside the batch's
device window, between the start event and the kernels, and between the groups' kernels. With it, the
writer enqueues ``wait(word >= n)`` first, then the start event, the launches and the end event, and
writes ``n`` into the word (pinned host memory the GPU reads) when it is done: the window holds only
the GPU's work, so the device-copy figures (``device_copy_ns``, ``kvwire_kv_device_copy_seconds_total``)
are the mover's rate, and the groups of a batch run back to back. The host's share stays in the
end-to-end figures.

Rules (as for the NCCL plane's armed sends): while the gate is held nothing may wait for the whole
device from the holding thread, so only launches of already-compiled kernels go behind it (a first
launch loads its module); the holder releases it in a ``finally``. A driver without stream memory
operations leaves the gate open (batches then time as before)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import torch

from kvwire.transfer.planes.common.stream_memops import WAIT_VALUE_GEQ, wait_value32

_WRAP = 1 << 32


class LaunchGate:
    """One writer thread's gate (made on that thread, with its device current). Not thread-safe."""

    def __init__(self) -> None:
        self._word = torch.zeros(1, dtype=torch.int32).pin_memory()  # device-visible under UVA
        self.address = int(self._word.data_ptr())
        self._cell = ctypes.c_uint32.from_address(self.address)
        self.count = 0  # the last value released (the wait is cyclic: it wraps at 2**32)
        self.usable = True

    @contextlib.contextmanager
    def held(self, stream: torch.cuda.Stream) -> Iterator[bool]:
        """Hold ``stream`` at the gate while the body enqueues; yields whether it is held."""
        value = (self.count + 1) % _WRAP
        if self.usable:
            try:
                code = wait_value32()(stream.cuda_stream, self.address, value, WAIT_VALUE_GEQ)
            except Exception:  # no driver entry point
                code = -1
            self.usable = code == 0
        if not self.usable:
            yield False
            return
        try:
            yield True
        finally:
            self._cell.value = value
            self.count = value
