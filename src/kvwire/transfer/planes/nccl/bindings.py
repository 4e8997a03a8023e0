"""Thin ctypes binding over ``libnccl.so.2`` (the copy that ships with PyTorch's CUDA wheels).

Only what kvwire's point-to-point data plane needs: unique ids, communicator init with a config
(non-blocking, channel bounds), grouped ``ncclSend``/``ncclRecv``, async-error polling, abort and
destroy. Nothing here imports torch at module level, so the module imports on CPU-only machines;
:func:`load_nccl` raises :class:`NcclUnavailableError` there.

Thread safety: one :class:`NcclComm` must be driven by one thread at a time (NCCL's rule); the
comm carries a lock that callers hold around a group of operations.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvwire.errors import ConfigError, PeerLostError, TransferError, TransferTimeout

NCCL_UNIQUE_ID_BYTES = 128
_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN)
_API_MAGIC = 0xCAFEBEEF
# We pass the config struct as it was in NCCL 2.27 (fields up to nvlsCTAs). NCCL copies
# min(size, its sizeof) bytes and resets every field newer than ``version`` to its default,
# so this prefix is valid for every library >= 2.27 (checked against init.cc parseCommConfig).
_CONFIG_VERSION = 22700

_ENQUEUE_TIMEOUT_S = 60.0
_ABORT_LOCK_WAIT_S = 0.5

# ncclResult_t
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
# ncclDataType_t: we move raw bytes
NCCL_UINT8 = 1


class NcclUnavailableError(TransferError):
    """libnccl could not be found or loaded (CPU-only machine, or a torch without CUDA)."""


class NcclError(TransferError):
    """An NCCL call returned an error code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
        ("commName", ctypes.c_char_p),
        ("collnetEnable", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("shrinkShare", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
    ]


@dataclass(frozen=True)
class CommConfig:
    """Per-communicator settings. ``min_ctas``/``max_ctas`` bound the channels (thread blocks) NCCL
    uses, hence its SM footprint and GPU memory; ``None`` leaves NCCL's default."""

    min_ctas: int | None = None
    max_ctas: int | None = None
    blocking: bool = False

    def __post_init__(self) -> None:
        for name in ("min_ctas", "max_ctas"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= 64:
                raise ConfigError(f"{name} must be in [1, 64], got {value}")
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise ConfigError(f"min_ctas {self.min_ctas} > max_ctas {self.max_ctas}")


def _candidate_paths() -> list[str]:
    paths: list[str] = []
    env = os.environ.get("KVWIRE_NCCL_LIBRARY")
    if env:
        paths.append(env)
    # A copy already mapped into this process (torch's libtorch_cuda links it): use the same one.
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({ln.split()[-1] for ln in maps if "libnccl.so" in ln and "/" in ln})
    except OSError:
        pass
    try:
        import nvidia.nccl as nv_nccl

        for root in list(nv_nccl.__path__):
            paths += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except ImportError:
        pass
    try:
        import torch

        paths += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so*")))
    except ImportError:
        pass
    paths.append("libnccl.so.2")
    return paths


class NcclLibrary:
    """The loaded library with typed function prototypes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        self._proto("ncclGetVersion", [ctypes.POINTER(c_int)])
        self._proto("ncclGetUniqueId", [ctypes.POINTER(UniqueId)])
        self._proto(
            "ncclCommInitRankConfig",
            [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int, ctypes.POINTER(_Config)],
        )
        self._proto("ncclCommGetAsyncError", [c_void_p, ctypes.POINTER(c_int)])
        self._proto("ncclCommAbort", [c_void_p])
        self._proto("ncclCommDestroy", [c_void_p])
        self._proto("ncclCommFinalize", [c_void_p])
        self._proto("ncclSend", [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p])
        self._proto("ncclRecv", [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p])
        self._proto("ncclGroupStart", [])
        self._proto("ncclGroupEnd", [])
        # User buffer registration (NCCL >= 2.19): zero-copy point-to-point between GPUs of one host
        # when both ends pass registered buffers (see kvwire.transfer.planes.nccl.memory).
        self.has_registration = all(
            hasattr(self._lib, name)
            for name in ("ncclCommRegister", "ncclCommDeregister", "ncclMemAlloc", "ncclMemFree")
        )
        if self.has_registration:
            self._proto("ncclCommRegister", [c_void_p, c_void_p, c_size_t, ctypes.POINTER(c_void_p)])
            self._proto("ncclCommDeregister", [c_void_p, c_void_p])
            self._proto("ncclMemAlloc", [ctypes.POINTER(c_void_p), c_size_t])
            self._proto("ncclMemFree", [c_void_p])
        self._lib.ncclGetErrorString.restype = ctypes.c_char_p
        self._lib.ncclGetErrorString.argtypes = [c_int]

    def _proto(self, name: str, argtypes: list[type]) -> None:
        fn = getattr(self._lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes

    def check(self, code: int, what: str) -> int:
        """Raise :class:`NcclError` unless ``code`` is success or in-progress; return the code."""
        if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            text = self._lib.ncclGetErrorString(code).decode(errors="replace")
            raise NcclError(f"{what} failed: {text} (code {code})", code)
        return code

    def version(self) -> tuple[int, int, int]:
        raw = ctypes.c_int()
        self.check(self._lib.ncclGetVersion(ctypes.byref(raw)), "ncclGetVersion")
        code = raw.value
        return (
            (code // 10000, code // 100 % 100, code % 100)
            if code >= 10000
            else (code // 1000, code // 100 % 10, code % 100)
        )

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))

    @property
    def raw(self) -> ctypes.CDLL:
        return self._lib


@functools.lru_cache(maxsize=1)
def load_nccl() -> NcclLibrary:
    """Find and load libnccl once per process (``KVWIRE_NCCL_LIBRARY`` overrides the search)."""
    errors: list[str] = []
    for path in _candidate_paths():
        try:
            return NcclLibrary(path)
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    raise NcclUnavailableError("libnccl.so.2 not found: " + "; ".join(errors[-3:]))


def nccl_available() -> bool:
    try:
        load_nccl()
    except NcclUnavailableError:
        return False
    return True


class NcclComm:
    """One communicator (here always two ranks: one peer pair). Non-blocking by default, so that
    init and every wait have a deadline and a hung peer is cut off with ``ncclCommAbort``.

    The caller must have selected the CUDA device (``torch.cuda.set_device``) before :meth:`create`.
    """

    def __init__(self, lib: NcclLibrary, handle: ctypes.c_void_p, rank: int, nranks: int) -> None:
        self._lib = lib
        self._handle = handle
        self.rank = rank
        self.nranks = nranks
        self.lock = threading.RLock()
        self._closed = False
        self._abort_requested = threading.Event()

    def _calls(self) -> ctypes.CDLL:
        return self._lib.raw

    @classmethod
    def begin(cls, unique_id: bytes, rank: int, nranks: int, config: CommConfig) -> NcclComm:
        """Start joining the communicator named by ``unique_id`` (returns at once for a non-blocking
        config: call :meth:`wait_ready`; :meth:`abort` cancels the join)."""
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise TransferError(f"NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        lib = load_nccl()
        uid = UniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        cfg = _make_config(config)
        handle = ctypes.c_void_p()
        code = lib.raw.ncclCommInitRankConfig(ctypes.byref(handle), nranks, uid, rank, ctypes.byref(cfg))
        if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS) and handle.value:
            lib.raw.ncclCommAbort(handle)
        lib.check(code, "ncclCommInitRankConfig")
        return cls(lib, handle, rank, nranks)

    @classmethod
    def create(
        cls, unique_id: bytes, rank: int, nranks: int, config: CommConfig, deadline: float
    ) -> NcclComm:
        """:meth:`begin` + wait until every rank joined; at ``deadline`` (``time.monotonic()``) the
        join is aborted and ``TransferTimeout`` raised."""
        comm = cls.begin(unique_id, rank, nranks, config)
        comm.wait_ready(deadline, "communicator init")
        return comm

    @property
    def closed(self) -> bool:
        return self._closed

    def async_error(self) -> int:
        """Current state: 0 success, 7 in progress, anything else an error."""
        if self._closed:
            raise PeerLostError("NCCL communicator is closed")
        state = ctypes.c_int()
        self._lib.check(
            self._lib.raw.ncclCommGetAsyncError(self._handle, ctypes.byref(state)), "ncclCommGetAsyncError"
        )
        return state.value

    def check_healthy(self) -> None:
        """Raise :class:`PeerLostError` if the communicator reported an asynchronous error."""
        state = self.async_error()
        if state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            text = self._lib.raw.ncclGetErrorString(state).decode(errors="replace")
            raise PeerLostError(f"NCCL communicator failed: {text} (code {state})")

    def wait_ready(self, deadline: float, what: str) -> None:
        """Poll until pending non-blocking NCCL calls finished; abort at the deadline."""
        pause_s = 1e-5
        while True:
            state = self.async_error()
            if state == NCCL_SUCCESS:
                return
            if state != NCCL_IN_PROGRESS:
                self.abort()
                text = self._lib.raw.ncclGetErrorString(state).decode(errors="replace")
                raise PeerLostError(f"NCCL {what} failed: {text} (code {state})")
            if self._abort_requested.is_set():
                self.abort()
                raise PeerLostError(f"NCCL {what} aborted")
            if time.monotonic() >= deadline:
                self.abort()
                raise TransferTimeout(f"NCCL {what} did not finish before its deadline")
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 1e-3)

    @contextmanager
    def group(self, deadline: float) -> Iterator[None]:
        """``ncclGroupStart`` ... ``ncclGroupEnd``: the sends/recvs inside become one launch."""
        calls = self._calls()
        with self.lock:
            self._lib.check(calls.ncclGroupStart(), "ncclGroupStart")
            try:
                yield
            finally:
                code = calls.ncclGroupEnd()
            self._lib.check(code, "ncclGroupEnd")
            if code == NCCL_IN_PROGRESS:
                self.wait_ready(deadline, "group launch")

    def send(self, ptr: int, num_bytes: int, peer: int, stream: int) -> None:
        """Enqueue ``ncclSend`` of ``num_bytes`` at device address ``ptr`` on CUDA ``stream``."""
        with self.lock:
            self._ensure_open()
            code = self._calls().ncclSend(ptr, num_bytes, NCCL_UINT8, peer, self._handle, stream)
            # outside a group a non-blocking comm may still be enqueueing: wait until it is on the stream
            if self._lib.check(code, "ncclSend") == NCCL_IN_PROGRESS:
                self.wait_ready(time.monotonic() + _ENQUEUE_TIMEOUT_S, "ncclSend")

    def recv(self, ptr: int, num_bytes: int, peer: int, stream: int) -> None:
        """Enqueue ``ncclRecv`` of ``num_bytes`` into device address ``ptr`` on CUDA ``stream``."""
        with self.lock:
            self._ensure_open()
            code = self._calls().ncclRecv(ptr, num_bytes, NCCL_UINT8, peer, self._handle, stream)
            # outside a group a non-blocking comm may still be enqueueing: wait until it is on the stream
            if self._lib.check(code, "ncclRecv") == NCCL_IN_PROGRESS:
                self.wait_ready(time.monotonic() + _ENQUEUE_TIMEOUT_S, "ncclRecv")

    @property
    def can_register(self) -> bool:
        """The library has user buffer registration (:meth:`register`)."""
        return self._lib.has_registration

    def register(self, ptr: int, num_bytes: int) -> int:
        """``ncclCommRegister``: let this communicator's sends/recvs use ``[ptr, ptr + num_bytes)``
        in place (zero-copy over NVLink when the peer's buffer is registered too). Returns the handle
        for :meth:`deregister`. Raises :class:`NcclUnavailableError` on a library without it."""
        if not self._lib.has_registration:
            raise NcclUnavailableError("this libnccl has no user buffer registration (needs >= 2.19)")
        handle = ctypes.c_void_p()
        with self.lock:
            self._ensure_open()
            code = self._lib.raw.ncclCommRegister(self._handle, ptr, num_bytes, ctypes.byref(handle))
            if self._lib.check(code, "ncclCommRegister") == NCCL_IN_PROGRESS:
                self.wait_ready(time.monotonic() + _ENQUEUE_TIMEOUT_S, "ncclCommRegister")
        return int(handle.value or 0)

    def deregister(self, handle: int) -> None:
        """``ncclCommDeregister`` of a :meth:`register` handle (a no-op once the comm is closed)."""
        with self.lock:
            if self._closed:
                return
            code = self._lib.raw.ncclCommDeregister(self._handle, ctypes.c_void_p(handle))
            if self._lib.check(code, "ncclCommDeregister") == NCCL_IN_PROGRESS:
                self.wait_ready(time.monotonic() + _ENQUEUE_TIMEOUT_S, "ncclCommDeregister")

    def _ensure_open(self) -> None:
        if self._closed:
            raise PeerLostError("NCCL communicator is closed")

    def abort(self) -> None:
        """``ncclCommAbort``: stops in-flight kernels of this comm and frees it. Idempotent, any thread.

        Normally taken under the lock; if another thread holds it for long (stuck inside NCCL, e.g. a
        blocking connection setup with a dead peer) the abort proceeds anyway: unblocking such a thread
        is what ``ncclCommAbort`` is for, and that thread touches the handle no more afterwards."""
        self._abort_requested.set()
        locked = self.lock.acquire(timeout=_ABORT_LOCK_WAIT_S)
        try:
            if self._closed:
                return
            self._closed = True
            self._lib.raw.ncclCommAbort(self._handle)
        finally:
            if locked:
                self.lock.release()

    def destroy(self, timeout_s: float = 5.0) -> None:
        """Orderly close when idle: ``ncclCommFinalize``, wait, ``ncclCommDestroy``; abort on error."""
        with self.lock:
            if self._closed:
                return
            try:
                self._lib.check(self._lib.raw.ncclCommFinalize(self._handle), "ncclCommFinalize")
                self.wait_ready(time.monotonic() + timeout_s, "finalize")
            except TransferError:
                self.abort()
                return
            self._closed = True
            if self._lib.raw.ncclCommDestroy(self._handle) != NCCL_SUCCESS:
                self._lib.raw.ncclCommAbort(self._handle)


def abort_all(comms: Sequence[NcclComm], timeout_s: float = 10.0) -> bool:
    """Abort ``comms`` at once, each on a thread of its own; True when every abort returned within
    ``timeout_s`` (a late one goes on, on its daemon thread).

    One after the other can deadlock: ``ncclCommAbort`` stops its own communicator's kernels, then
    frees device memory, which waits for every kernel on the device, including another
    communicator's kernel still spinning on a dead peer (seen with two lanes to a killed receiver:
    the first abort never returned). Started together, each sets its abort flag first."""
    return run_together([comm.abort for comm in comms], "kvwire-nccl-abort", timeout_s)


def run_together(calls: Sequence[Callable[[], object]], name: str, timeout_s: float) -> bool:
    """Run ``calls`` at once, each on a daemon thread of its own named ``name``, and wait for them
    until ``timeout_s`` in all; True when every call returned by then (a late one goes on alone).
    For teardown steps that may block inside NCCL on a peer that is gone."""
    threads = [threading.Thread(target=call, name=name, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def _make_config(config: CommConfig) -> _Config:
    cfg = _Config()
    cfg.size = ctypes.sizeof(_Config)
    cfg.magic = _API_MAGIC
    cfg.version = _CONFIG_VERSION
    for name in (
        "cgaClusterSize",
        "splitShare",
        "trafficClass",
        "collnetEnable",
        "CTAPolicy",
        "shrinkShare",
        "nvlsCTAs",
    ):
        setattr(cfg, name, _UNDEF_INT)
    cfg.netName = None
    cfg.commName = None
    cfg.blocking = 1 if config.blocking else 0
    cfg.minCTAs = _UNDEF_INT if config.min_ctas is None else config.min_ctas
    cfg.maxCTAs = _UNDEF_INT if config.max_ctas is None else config.max_ctas
    return cfg
