"""A device-visible "the KV is written" word: arm a send before its data exists; the GPU starts it.

A P instance knows which blocks it will send (and the receiver's chunk plan arrives with the grant)
long before its forward pass ends. With a :class:`DeviceSignal` the whole transfer is handed to the
plane then: the plane enqueues, on its send stream, a wait for the word (``cuStreamWaitValue32``)
and everything after it (gathers, NCCL sends, or one graph replay). When the forward has written
the KV, the producer's stream flips the word with :meth:`DeviceSignal.fire` (``cuStreamWriteValue32``:
stream ordered after the writes, with a memory fence; one driver call, ~5 us of host time where a
torch copy took 20-40 us) and the GPU goes straight on: no host step between the last KV write and
the first byte on the wire (a host hand-off costs 0.2-0.4 ms of Python, see decision 064).

**While a transfer is armed, nothing on that GPU may synchronize the whole device** (
``torch.cuda.synchronize``, ``cudaFree`` when the caching allocator releases memory, the first
launch of a kernel, which loads its module): that waits for the send stream, which waits for the
signal, which the blocked thread was to fire. The plane's stall watchdog ends such a wait (it
abandons the signals before it aborts the communicator), but only after ``stall_timeout_s``. The
same rule already holds for posted NCCL receives (decision 062).

The words live in pinned host memory (device-mapped), so they are set from the start with no
stream work, and the plane can give a transfer up from the host at once (:meth:`abandon`: its
waiting stream goes on, and the chunks behind the wait carry "not real" status words so the
receiver drops them). Two words: the *state* (what streams wait on; the producer's stream writes
it) and the *real* flag the chunks' status words are copied from after the wait (only the host
writes it, and :meth:`abandon` clears it before it releases the wait, so a firing copy still in
flight can never turn an abandoned transfer's chunks back into "real").
"""

from __future__ import annotations

import enum
import threading

import torch

from kvwire.errors import TransferError
from kvwire.transfer.planes.common.stream_memops import (
    WAIT_VALUE_GEQ,
    WRITE_VALUE_DEFAULT,
    wait_value32,
    write_value32,
)

_CU_STREAM_WAIT_VALUE_GEQ = WAIT_VALUE_GEQ
_CU_STREAM_WRITE_VALUE_DEFAULT = WRITE_VALUE_DEFAULT
_wait_value32 = wait_value32
_write_value32 = write_value32


class SignalState(enum.IntEnum):
    ARMED = 0  # not written yet: streams waiting on it wait
    READY = 1  # fired by the producer's stream after the KV writes
    ABANDONED = 2  # given up (cancel, close): waiting streams go on, what follows is "not real"


class DeviceSignal:
    """One transfer's readiness word (see the module docstring). Made on any thread, no stream work."""

    def __init__(self) -> None:
        self.words = torch.tensor([int(SignalState.ARMED), 1], dtype=torch.int32).pin_memory()
        self.real = self.words[1:2]  # the status words' "real" flag: 1 until abandoned (then 2)
        self.address = int(self.words.data_ptr())  # device-visible (pinned host memory under UVA)
        self._lock = threading.Lock()

    @property
    def state(self) -> SignalState:
        """The state word as the host sees it now (READY once the firing copy has run)."""
        return SignalState(int(self.words[0]))

    def fire(self, stream: torch.cuda.Stream | None = None) -> None:
        """Mark the KV written: a write of READY enqueued on ``stream`` (default: the current stream),
        after everything enqueued there before (the forward's KV writes) and a memory fence.

        On the critical path: pass the stream when you have it (``torch.cuda.current_stream()``
        builds a Python object, 10-40 us on a slow host)."""
        raw = stream.cuda_stream if stream is not None else _current_raw_stream()
        code = _write_value32()(raw, self.address, _READY, _CU_STREAM_WRITE_VALUE_DEFAULT)
        if code != 0:
            raise TransferError(f"cuStreamWriteValue32 failed (CUresult {code})")

    def abandon(self) -> None:
        """Give the transfer up from the host: clear the real flag, then release waiting streams
        (state ABANDONED unless already READY). Chunks whose status was copied before this went
        out as real, as if they had left before the cancel."""
        with self._lock:
            self.words[1] = int(SignalState.ABANDONED)
            if int(self.words[0]) == SignalState.ARMED:
                self.words[0] = int(SignalState.ABANDONED)


_READY = int(SignalState.READY)


def _current_raw_stream() -> int:
    """The current CUDA stream's handle without building a ``torch.cuda.Stream`` (the raw getter
    Triton uses too; the public call when a torch build lacks it)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is None:
        return int(torch.cuda.current_stream().cuda_stream)
    return int(getter(torch._C._cuda_getDevice()))


def prepare(device: torch.device) -> None:
    """Load the driver entry points now (at plane or engine start), so a first
    :meth:`DeviceSignal.fire` or wait never loads anything. (``device``: kept for callers; the entry
    points serve every device.)"""
    del device
    _wait_value32()
    _write_value32()


def wait_ready(stream: torch.cuda.Stream, signal: DeviceSignal) -> None:
    """Enqueue on ``stream``: wait until ``signal`` is no longer ARMED (READY or ABANDONED)."""
    ready = int(SignalState.READY)
    code = _wait_value32()(stream.cuda_stream, signal.address, ready, _CU_STREAM_WAIT_VALUE_GEQ)
    if code != 0:
        raise TransferError(f"cuStreamWaitValue32 failed (CUresult {code})")
