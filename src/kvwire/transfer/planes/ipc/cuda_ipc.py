"""CUDA IPC memory handles through the driver API (``libcuda.so.1``, present wherever CUDA runs).

Why the driver API and not ``torch.multiprocessing.reductions``: torch's CUDA sharing keeps a
reference-count file in shared memory per exported storage (leaked on ``kill -9``) and maps whole
storages; the plane needs the handle of the *allocation* under any tensor (the caching allocator
carves tensors out of larger segments: ``cuMemGetAddressRange`` gives the segment) and must close a
peer's mappings on its own schedule. Functions here expect the tensor's device to be current.

Limits: memory from PyTorch's ``expandable_segments`` allocator (VMM) has no legacy IPC handle
(``cuIpcGetMemHandle`` fails): the plane then fails the transfer with the driver's error.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from kvwire.errors import TransferError

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 0x1


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


@functools.cache
def _lib() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise TransferError(f"CUDA IPC needs the CUDA driver (libcuda.so.1): {exc}") from exc
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(result, ctypes.byref(name))
        raise TransferError(f"{what} failed: {(name.value or b'?').decode()} ({result})")


def allocation_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(base address, bytes) of the driver allocation that holds ``tensor``'s storage."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(
        _lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()),
        "cuMemGetAddressRange",
    )
    return base.value, size.value


def export_handle(base: int) -> bytes:
    """The IPC handle of the allocation starting at ``base``."""
    handle = _Handle()
    _check(_lib().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES)  # all 64 bytes: NULs included


def open_handle(handle: bytes) -> int:
    """Map a peer's allocation into this process; its base address here."""
    if len(handle) != HANDLE_BYTES:
        raise TransferError(f"CUDA IPC handle of {len(handle)} bytes (want {HANDLE_BYTES})")
    raw = _Handle()
    ctypes.memmove(ctypes.addressof(raw), handle, HANDLE_BYTES)
    address = ctypes.c_uint64()
    _check(
        _lib().cuIpcOpenMemHandle_v2(ctypes.byref(address), raw, _LAZY_ENABLE_PEER_ACCESS),
        "cuIpcOpenMemHandle",
    )
    return address.value


def close_handle(address: int) -> None:
    """Unmap a peer allocation mapped by :func:`open_handle` (errors ignored: the peer may be gone)."""
    _lib().cuIpcCloseMemHandle(address)


class DeviceBytes:
    """``__cuda_array_interface__`` of raw device memory, so that ``torch.as_tensor`` wraps it
    (a ``uint8`` tensor that aliases the peer's allocation; torch never frees it)."""

    def __init__(self, address: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }


def wrap(address: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(DeviceBytes(address, num_bytes), device=device)
