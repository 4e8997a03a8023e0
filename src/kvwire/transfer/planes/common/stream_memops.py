"""CUDA stream memory operations through the driver API (``libcuda.so.1``): a stream that waits on a
32-bit word in device-visible memory (``cuStreamWaitValue32``) and a stream-ordered write of one
(``cuStreamWriteValue32``). Used by the NCCL plane's armed sends
(:mod:`kvwire.transfer.planes.nccl.device_signal`) and the IPC plane's launch gate
(:mod:`kvwire.transfer.planes.ipc.gate`).

The wait is *cyclic*: ``GEQ`` passes once ``(int32)(*word - value) >= 0``, so a word that counts up
and wraps keeps working."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from kvwire.errors import TransferError

WAIT_VALUE_GEQ = 0x0
WRITE_VALUE_DEFAULT = 0x0  # with a memory fence before the write


def _driver_entry(name: str) -> Any:
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError) as exc:
        raise TransferError(f"{name} unavailable: {exc}") from exc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=1)
def wait_value32() -> Any:
    """``cuStreamWaitValue32(stream, address, value, flags) -> CUresult``."""
    return _driver_entry("cuStreamWaitValue32_v2")


@functools.lru_cache(maxsize=1)
def write_value32() -> Any:
    """``cuStreamWriteValue32(stream, address, value, flags) -> CUresult``."""
    return _driver_entry("cuStreamWriteValue32_v2")
