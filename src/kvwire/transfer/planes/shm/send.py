"""Sender half of the shared-memory plane, and the copies both halves make.

Read in order (docs/decisions/139-planes-in-few-modules.md): the run copier (the one copy
primitive, native when built), the ring, the grant message a receiver sends (:class:`ShmDest`),
the sender's side of the grant table (slot locks, :class:`GrantView`), the one-copy layer's plan
and copier, and last the writer (:class:`Outbound`), one thread per peer epoch. The plane and its
receiver half (reader, grant table, regions, quarantine) are :mod:`kvwire.transfer.planes.shm.plane`.

The writer connects to the receiver's abstract Unix socket, authenticates (the TCP plane's hello),
receives and maps the receiver's ring, grant table and exported shared regions, then per queued
layer:

* one-copy path: the receiver granted a destination in one of those regions, so the writer copies
  the layer's block runs straight into it (holding the grant's slot lock, which the receiver's
  cancel takes to revoke: :class:`GrantView`) and sends one DONE frame. Layers of one transfer queued
  together go as a batch: one lock hold for them (the grant re-checked before each layer), their
  DONE frames written together, at least every ``ANNOUNCE_S`` while the batch lasts;
* ring path (any other destination): copies the byte runs into the ring chunk by chunk and
  announces each chunk with a small frame. The receiver returns credit (the ring position it has
  consumed) after copying each chunk out, so the ring bounds the bytes in flight and the two copies
  (this gather, the receiver's scatter) overlap chunk by chunk.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import importlib
import logging
import mmap
import os
import queue
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from kvwire.transfer.memory import PeerRef, SendItem, check_peer_memfd, sealed_memfd
from kvwire.transfer.planes.base import fail_queued
from kvwire.transfer.planes.common.hello import prove_hello
from kvwire.transfer.planes.common.outbound import OutboundLink
from kvwire.transfer.planes.common.runs import Run, pair_runs
from kvwire.transfer.planes.common.wire import CANCEL_WAIT_S, POLL_S
from kvwire.transfer.planes.shm.wire import (
    CHUNK_BYTES,
    CREDIT,
    FRAME,
    MAGIC,
    VERSION,
    Frame,
    recv_setup,
)

if TYPE_CHECKING:
    from kvwire.transfer.planes.shm.plane import ShmPlane

Bytes = npt.NDArray[np.uint8]
log = logging.getLogger("kvwire.transfer")


# =================================================================================================
# Run copies: the one copy primitive
# =================================================================================================

# Copying byte runs ``dst[d:d+n] = src[s:s+n]`` between flat ``uint8`` arrays: the shared-memory
# plane's one copy primitive (the one-copy path's block runs, the ring's chunks).
#
# Native when the C extension ``_copy_runs`` is built (``pip install`` builds it wherever a C compiler
# is found): one call per batch of runs, bounds checked in C, the copies without the GIL. Otherwise a
# Python loop of ``memoryview`` slice assignments holding the GIL, slower (measured in
# docs/decisions/112-native-run-copies.md) and logged once as a warning.

_native: ModuleType | None
try:
    _native = importlib.import_module("kvwire.transfer.planes.shm._copy_runs")
    NATIVE_ERROR = ""
except ImportError as exc:  # built without a C compiler: the Python loop
    _native = None
    NATIVE_ERROR = str(exc)

#: True when runs are copied by the C extension (without the GIL)
NATIVE = _native is not None

#: a one-copy layer of at least this many bytes is written with non-temporal stores: it goes to
#: another process's cache, and a transfer of such layers (32 of them: 128 MiB and more) outgrows any
#: CPU cache, so the stores skip reading the destination first and leave the sender's caches alone.
#: On the Xeon GPU host that took scattered 32 KiB runs from 0.59-0.66 to 0.76-0.89 of a streaming
#: memcpy; on the AMD dev box both stores run alike (docs/decisions/112-native-run-copies.md)
STREAM_MIN_BYTES = 4 << 20
_warned = False


def run_table(runs: Sequence[Run]) -> npt.NDArray[np.int64]:
    """``runs`` as the native copier takes them: an (N, 3) int64 array, read-only (the copier checks
    the runs, then copies them without the GIL: nothing may change them in between)."""
    table = np.array(runs, dtype=np.int64).reshape(-1, 3)
    table.flags.writeable = False
    return table


def copy_runs(
    src: Bytes, dst: Bytes, table: npt.NDArray[np.int64], *, checked: bool = False, stream: bool = False
) -> None:
    """Copy every run of ``table`` (:func:`run_table`). Raises ValueError, copying nothing, when a run
    leaves ``src`` or ``dst``; ``checked``: the caller has checked that already (the Python loop then
    skips its own check; the native copier always checks, at about a nanosecond a run).
    ``stream``: non-temporal stores (native copier on x86-64), for bytes this process will not read
    again and too many to stay in cache (:data:`STREAM_MIN_BYTES`)."""
    if _native is not None:
        _native.copy_runs(src, dst, table, stream)
        return
    _warn_once()
    if not checked:
        check_table(table, src.size, dst.size)
    with src.data as s_view, dst.data as d_view:  # released here: mmaps over them can close
        for s, d, n in table.tolist():
            d_view[d : d + n] = s_view[s : s + n]


def check_table(table: npt.NDArray[np.int64], src_size: int, dst_size: int) -> None:
    """Raises ValueError when a run of ``table`` leaves a source of ``src_size`` bytes or a
    destination of ``dst_size`` bytes (what the native copier checks before copying)."""
    s, d, n = table[:, 0], table[:, 1], table[:, 2]
    bad = (s < 0) | (d < 0) | (n < 0) | (s > src_size - n) | (d > dst_size - n)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"run {i} {tuple(table[i].tolist())} outside the source ({src_size} B) or destination "
            f"({dst_size} B)"
        )


def describe_copier() -> str:
    """Which copier runs, for logs and benchmark tables."""
    return "native" if NATIVE else f"python ({NATIVE_ERROR})"


def warn_if_python() -> None:
    """Log the fallback's warning (once per process) when the native copier is missing."""
    if not NATIVE:
        _warn_once()


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "shared-memory copies run in Python, holding the GIL (the native copier is not built: %s); "
            "reinstall kvwire where a C compiler is available",
            NATIVE_ERROR,
        )


# =================================================================================================
# The ring
# =================================================================================================

# The ring is a ``memfd`` (an anonymous file: it has no name anywhere, so nothing can leak when a
# process is killed; the kernel frees it when the last process that maps it exits or unmaps it). The
# receiver creates it and passes the descriptor to the sender over their Unix socket (SCM_RIGHTS).
#
# Copies go through :func:`copy_runs`: one ``memcpy`` per byte
# run, a chunk's runs in one call without the GIL (native copier), so the sender's gather and the
# receiver's scatter (other processes, or other threads of one process) overlap.


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


# =================================================================================================
# The grant message
# =================================================================================================

# When a receiver's destination lies in a :mod:`shared region <kvwire.transfer.memory>`, its
# grant describes it as (region id, byte spans from the region's base, grant slot and token) and the
# sender, which mapped the region at link setup, copies its blocks straight into it: the block runs
# are paired (``planes.common.runs.pair_runs``: runs contiguous on both sides merge) and copied by
# :class:`RunCopier` (:func:`copy_runs`: one native call per layer, without the GIL), optionally
# split over several threads.


class ShmDest(msgspec.Struct, frozen=True):
    """Where one granted layer goes on the one-copy path."""

    transfer_id: str
    layer: int
    region: int  # the receiver's shared region id (mapped by the sender at link setup)
    base: int  # the destination tensor's first byte, from the region's base
    slot: int  # grant-table slot guarding the transfer's writes
    token: int
    # (offset from ``base``, bytes), in payload order: the same for every layer of a transfer
    # (same blocks, same layer geometry), so the sender plans the copies once per transfer
    spans: Sequence[tuple[int, int]]


class WireDest(msgspec.Struct, array_like=True, frozen=True):
    """A ShmDest on the wire: its spans by reference."""

    transfer_id: str
    layer: int
    region: int
    base: int
    slot: int
    token: int
    span_set: int  # index into DirectInfo.span_sets


class DirectInfo(msgspec.Struct, frozen=True):
    """The receiver's plane_info on a Grant: one-copy destinations of layers it just posted. Layers
    with equal spans (a transfer's layers) share one entry of ``span_sets``, so a grant of L layers
    of B blocks carries about B spans, not L x B."""

    dests: list[WireDest]
    span_sets: list[list[tuple[int, int]]]


def encode_direct(dests: Sequence[ShmDest]) -> bytes:
    """The plane_info bytes granting ``dests``."""
    sets: list[Sequence[tuple[int, int]]] = []
    wire = []
    for d in dests:
        if not sets or (sets[-1] is not d.spans and sets[-1] != d.spans):
            sets.append(d.spans)
        wire.append(WireDest(d.transfer_id, d.layer, d.region, d.base, d.slot, d.token, len(sets) - 1))
    return msgspec.msgpack.encode(DirectInfo(wire, [list(spans) for spans in sets]))


def decode_direct(info: bytes) -> list[ShmDest]:
    """The destinations in a peer's plane_info (layers sharing a span set share its list). Raises
    ValueError when it does not decode or refers to a missing span set."""
    try:
        grant = msgspec.msgpack.decode(info, type=DirectInfo)
    except (msgspec.DecodeError, RecursionError) as exc:  # nesting past msgspec's limit: RecursionError
        raise ValueError(str(exc)) from exc
    sets = grant.span_sets
    if any(not 0 <= d.span_set < len(sets) for d in grant.dests):
        raise ValueError("destination refers to a missing span set")
    return [
        ShmDest(d.transfer_id, d.layer, d.region, d.base, d.slot, d.token, sets[d.span_set])
        for d in grant.dests
    ]


# =================================================================================================
# Grant slots: the sender's side of the grant table
# =================================================================================================

# The grant table: how a receiver revokes a sender's right to write into its shared KV cache.
#
# On the one-copy path the *sender* writes into the receiver's blocks, so the receiver's ``cancel``
# cannot simply stop copying (as it does on the ring path): it must be sure that no write of the
# cancelled transfer is under way or can start later, before the caller reuses those blocks.
#
# The table is a small memfd of 64-bit tokens, one slot per granted transfer, shared with one
# sending peer (passed at its links' setup; each peer has a table of its own: its grant region). A
# grant names (slot, token). The sender holds a byte-range lock on the slot (an
# open-file-description lock, ``F_OFD_SETLK``: per descriptor, so two threads of one process exclude
# each other too, and the kernel drops it when a holder dies) while it copies the layers queued for
# the transfer, and re-reads the token before each layer. The receiver revokes by zeroing the token
# and then taking the same lock: once that returns, nothing of the transfer is being written and
# nothing will be. A sender that read the token before it was zeroed finishes the layer under way,
# sees the zero before the next one and lets go, so a revoke waits for at most one layer's copy
# however many layers the sender holds the slot for. The lock is what guarantees exclusion (a stale
# read of the token only delays the sender's stop; the revoke still waits for the lock).
# The receiver's side (:class:`~kvwire.transfer.planes.shm.plane.GrantTable`: claim, revoke) lives
# with the receiver; the locks both sides take, and the sender's mapping, are here.

SLOT_BYTES = 8
_FLOCK = "hhqqi4x"  # struct flock (Linux): type, whence, start, len, pid (0 for OFD locks)
_WAIT_STEP_S = 0.0002


def _lock(fd: int, slot: int, lock_type: int, wait: bool) -> bool:
    """Set or clear the OFD lock on ``slot``'s byte; False when ``wait`` is off and it is held."""
    request = struct.pack(_FLOCK, lock_type, os.SEEK_SET, slot, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, request)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES) and not wait:
            return False
        raise
    return True


def lock_slot(fd: int, slot: int, timeout_s: float) -> bool:
    """Take ``slot``'s lock, polling until ``timeout_s``; False when it stayed held."""
    deadline = time.monotonic() + timeout_s
    while not _lock(fd, slot, fcntl.F_WRLCK, wait=False):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_WAIT_STEP_S)
    return True


def unlock_slot(fd: int, slot: int) -> None:
    _lock(fd, slot, fcntl.F_UNLCK, wait=False)


def slot_unheld(fd: int, slot: int, timeout_s: float) -> bool:
    """Take ``slot``'s lock (polling until ``timeout_s``; 0: one try) and let go of it at once: True
    when nobody held it by then, so nothing writes under the slot any more (the receiver's revoke
    and quarantine release, :class:`~kvwire.transfer.planes.shm.plane.GrantTable`)."""
    if not lock_slot(fd, slot, timeout_s):
        return False
    unlock_slot(fd, slot)
    return True


class GrantView:
    """A sender's mapping of a receiver's table, with a descriptor of its own for the locks."""

    def __init__(self, fd: int, size: int) -> None:
        """Takes ownership of ``fd`` (closed here)."""
        try:
            check_peer_memfd(fd, size)
            if size % SLOT_BYTES:
                raise ValueError(f"grant table of {size} bytes is not whole slots")
            # a new open file description: OFD locks of the receiver's description would not exclude
            self.fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        finally:
            os.close(fd)
        try:
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.tokens: npt.NDArray[np.uint64] = np.frombuffer(self._map, dtype=np.uint64)

    @contextlib.contextmanager
    def holding(self, slot: int, token: int, timeout_s: float) -> Iterator[Callable[[], bool]]:
        """Hold ``slot``'s lock; yields a check to call before each write: whether the grant is
        still valid (False: revoked, write nothing more). Raises TimeoutError when the receiver
        holds the lock past ``timeout_s``."""
        if not 0 <= slot < self.tokens.size:
            raise ValueError(f"grant slot {slot} outside the table ({self.tokens.size} slots)")
        if not lock_slot(self.fd, slot, timeout_s):
            raise TimeoutError(f"grant slot {slot} stayed locked for {timeout_s} s")
        tokens = self.tokens
        try:
            yield lambda: int(tokens[slot]) == token
        finally:
            unlock_slot(self.fd, slot)

    def close(self) -> None:
        del self.tokens
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)


# =================================================================================================
# One-copy layers: mapped regions, copy plans, the copier
# =================================================================================================


class MappedRegions:
    """A sender's mappings of one peer epoch's shared regions (region id -> writable bytes)."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self.arrays: dict[int, Bytes] = {}

    def add(self, region_id: int, fd: int, size: int) -> None:
        """Map a region received from the peer; closes ``fd`` (the mapping keeps the memory)."""
        try:
            check_peer_memfd(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps[region_id] = mapping
        self.arrays[region_id] = np.frombuffer(mapping, dtype=np.uint8)

    def close(self) -> None:
        """Unmap everything (a view still alive elsewhere defers that region's unmap to the GC)."""
        self.arrays.clear()
        for mapping in self._maps.values():
            with contextlib.suppress(BufferError):
                mapping.close()
        self._maps.clear()


def layer_runs(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> list[Run]:
    """The copies moving the ``src`` spans' bytes into the ``dst`` spans (``pair_runs``), with fast
    paths for the common cases: paged -> paged (span i of each side has the same length: block
    runs that are contiguous on both sides are single spans already) and paged -> one span (a
    receive buffer: a transfer offered before its blocks were known). Raises ValueError when the
    totals differ."""
    if len(src) == len(dst) and all(a[1] == b[1] for a, b in zip(src, dst, strict=True)):
        return [(a[0], b[0], a[1]) for a, b in zip(src, dst, strict=True) if a[1] > 0]
    if len(dst) == 1 and sum(n for _, n in src) == dst[0][1]:
        return _into_one_span(src, dst[0][0])
    return pair_runs(src, dst)


def _into_one_span(src: Sequence[tuple[int, int]], at: int) -> list[Run]:
    """``pair_runs(src, [(at, total)])``: the source spans one after another from ``at``, spans
    that continue each other merged."""
    runs: list[Run] = []
    for offset, n in src:
        if n <= 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((offset, at, n))
        at += n
    return runs


class PlannedRuns(list[Run]):
    """A layer plan's runs, with the native copier's table of them made once for every layer that
    reuses the plan."""

    @functools.cached_property
    def table(self) -> npt.NDArray[np.int64]:
        """The runs as an (N, 3) int64 array (:func:`run_table`)."""
        return run_table(self)

    @functools.cached_property
    def num_bytes(self) -> int:
        return sum(n for _, _, n in self)


def copy_order(runs: list[Run]) -> list[Run]:
    """``runs`` ordered by source offset. A request's blocks lie in any order in a cache; reading
    them in address order lets the hardware prefetcher run ahead across blocks (measured faster
    than payload order for scattered 32 KiB runs: docs/decisions/080-shm-one-copy.md)."""
    return sorted(runs)


class RunPlans:
    """The source-ordered runs of the layer being written. Consecutive layers of one transfer have
    equal spans (offsets relative to each layer's tensor), so the last plan is kept and reused while
    the spans repeat; only its bounds are checked against each layer's sizes."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._runs = PlannedRuns()
        self._src_end = self._dst_end = 0  # the furthest byte a run reads / writes

    def runs(
        self, src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]], src_size: int, dst_size: int
    ) -> PlannedRuns:
        """Raises ValueError when the spans' totals differ or a run leaves its source or destination."""
        key = (src, dst)
        if self._key is None or self._key != key:
            runs = PlannedRuns(copy_order(layer_runs(src, dst)))
            if any(s < 0 or d < 0 for s, d, _ in runs):
                raise ValueError("negative span offset")
            self._key, self._runs = None, runs
            self._src_end = max((s + n for s, _, n in runs), default=0)
            self._dst_end = max((d + n for _, d, n in runs), default=0)
            self._key = key
        if self._src_end > src_size or self._dst_end > dst_size:
            raise ValueError(
                f"runs reach byte {self._src_end} of the source ({src_size}) and {self._dst_end} of "
                f"the destination ({dst_size})"
            )
        return self._runs


class SourceViews:
    """Flat ``uint8`` arrays over source tensors' bytes, kept by (address, bytes): the layer tensors
    of a KV cache come back for every transfer, and making a view through torch costs about 30 us
    a layer. A view does not hold its tensor: use it only while a tensor at that address and of that
    size is alive (the send item holds it), which makes the view valid whatever tensor it was made
    for. Bounded (cleared when full)."""

    MAX_VIEWS = 1024

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], Bytes] = {}

    def of(self, tensor: torch.Tensor) -> Bytes:
        """The bytes of a contiguous CPU tensor (any other tensor: a view made by torch)."""
        num_bytes = tensor.numel() * tensor.element_size()
        if num_bytes == 0 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return tensor.detach().reshape(-1).view(torch.uint8).numpy()
        key = (tensor.data_ptr(), num_bytes)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self.MAX_VIEWS:
                self._views.clear()
            view = np.ctypeslib.as_array((ctypes.c_uint8 * num_bytes).from_address(key[0]))
            self._views[key] = view
        return view


def halves(runs: Sequence[Run]) -> tuple[list[Run], list[Run]]:
    """``runs`` cut at half their bytes (a run across the cut is split): the test hook's stop in the
    middle of a layer (``plane.STOP_MID_LAYER_ENV``)."""
    cut = sum(n for _, _, n in runs) // 2
    first: list[Run] = []
    rest: list[Run] = []
    done = 0
    for s, d, n in runs:
        take = min(n, max(cut - done, 0))
        if take:
            first.append((s, d, take))
        if n > take:
            rest.append((s + take, d + take, n - take))
        done += n
    return first, rest


class RunCopier:
    """Copies byte runs ``dst[d:d+n] = src[s:s+n]`` (flat ``uint8`` arrays). Stop with :meth:`close`.

    One thread (the default): one :func:`copy_runs` call on the caller's thread per layer (native:
    the GIL is released for the copies; a layer of ``STREAM_MIN_BYTES`` or more is written with
    non-temporal stores). More threads: the runs are cut into ``threads`` pieces of about equal
    bytes, copied on the caller's thread and ``threads - 1`` helpers at once (in parallel only with
    the native copier; the Python loop holds the GIL). Which is faster depends on the cores free:
    ``kvwire bench transfer --backend shm --shm-copy-threads N`` measures it (docs/performance.md).
    """

    _MIN_SPLIT = 8  # runs: fewer go on the caller's thread only

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvwire-shm-copy")
            if self.threads > 1
            else None
        )

    def copy(self, src: Bytes, dst: Bytes, runs: Sequence[Run]) -> None:
        """Raises ValueError, copying nothing, when a run leaves ``src`` or ``dst``."""
        planned = runs if isinstance(runs, PlannedRuns) else PlannedRuns(runs)
        stream = planned.num_bytes >= STREAM_MIN_BYTES
        if self._pool is None or len(planned) < self._MIN_SPLIT:
            copy_runs(src, dst, planned.table, stream=stream)
            return
        check_table(planned.table, src.size, dst.size)  # before any piece copies
        parts = _split(planned.table, self.threads)
        futures: list[Future[None]] = [
            self._pool.submit(copy_runs, src, dst, part, checked=True, stream=stream) for part in parts[1:]
        ]
        try:
            copy_runs(src, dst, parts[0], checked=True, stream=stream)
        finally:
            for future in futures:
                future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _split(table: npt.NDArray[np.int64], parts: int) -> list[npt.NDArray[np.int64]]:
    """``table``'s runs cut into ``parts`` consecutive pieces of about equal bytes."""
    ends = np.cumsum(table[:, 2])
    total = int(ends[-1]) if len(ends) else 0
    cuts = np.searchsorted(ends, [total * k / parts for k in range(1, parts)], side="left") + 1
    return np.split(table, np.minimum(cuts, len(table)))


# =================================================================================================
# The writer
# =================================================================================================

# while a batch lasts, its written layers are announced (DONE frames) at least this often: a batch
# holds everything queued, so the receiver learns of its first layers before the last is copied
ANNOUNCE_S = 0.01


def _payload_bytes(item: SendItem) -> int:
    if item.spans is not None:
        return item.spans.num_bytes
    return item.tensor.numel() * item.tensor.element_size()


class _Cancelled(Exception):
    """The item's transfer was cancelled between two chunks."""


class Outbound(OutboundLink):
    """Writer thread for one peer epoch."""

    kind = "shm"

    def __init__(self, plane: ShmPlane, peer: PeerRef) -> None:
        self.plane = plane
        super().__init__(peer, plane.board)
        self._ring: mmap.mmap | None = None
        self._grants: GrantView | None = None
        self._regions = MappedRegions()
        self._plans = RunPlans()  # the layers of one transfer share their copy plan
        self._sources = SourceViews()  # the sender's KV cache tensors, viewed once
        self._head = 0  # ring position of the next chunk (monotonic)
        self._consumed = 0  # ring position the receiver has copied out up to
        self._credit_buf = b""

    def _connect(self) -> socket.socket:
        links = self.plane.config.links
        sock = self._dial_unix(links.handshake_timeout_s)
        prove_hello(sock, self.plane.secret, self.plane.instance_id, self.peer.instance_id, MAGIC, VERSION)
        (ring_fd, ring_bytes), (table_fd, table_bytes), regions = recv_setup(sock)
        try:
            self._ring = map_ring(ring_fd, ring_bytes)
            self._grants = GrantView(table_fd, table_bytes)
            for region_id in list(regions):
                fd, size = regions.pop(region_id)
                self._regions.add(region_id, fd, size)
        finally:  # descriptors not consumed above (an error part way)
            for fd, _ in regions.values():
                os.close(fd)
        sock.settimeout(links.link_timeout_s)  # every write's deadline from here on
        return sock

    link_errors = (OSError, ConnectionError, ValueError)

    def _write_loop(self) -> None:
        self._pump(self._connect())

    def _link(self) -> str:
        return f"shared-memory link to {self.peer.endpoint}"

    def _peer_failed(self, reason: str) -> None:
        self.plane.callbacks.on_peer_failed(self.peer.instance_id, reason)

    def _pump(self, sock: socket.socket) -> None:
        """Write queued layers until stopped (the ring's array lives in this frame only, so that
        ``_finish`` can unmap the ring). Layers queued together go as one batch: consecutive
        one-copy layers of a transfer are written under one hold of its grant and announced with
        one write of their DONE frames (fewer system calls, and fewer GIL hand-offs to the
        process's other threads, per layer)."""
        assert self._ring is not None
        ring = ring_array(self._ring)
        stop = False
        while not stop and not self.stopped.is_set():
            try:
                item = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                self._read_credit(sock, wait=False)  # also notices a receiver that went away
                continue
            if item is None:
                break
            batch, stop = self._batch(item)
            direct: list[tuple[SendItem, ShmDest]] = []
            for item in batch:
                if self.plane.is_cancelled(item.transfer_id):
                    continue
                dest = self.plane.take_dest(self.peer.instance_id, item.transfer_id, item.layer_index)
                if dest is not None and dest.region in self._regions.arrays:
                    if direct and (direct[0][1].slot, direct[0][1].token) != (dest.slot, dest.token):
                        self._write_direct(sock, direct)
                        direct = []
                    direct.append((item, dest))
                    continue
                self._write_direct(sock, direct)
                direct = []
                try:
                    self._write(sock, ring, item)
                except _Cancelled:
                    continue
                self.plane.callbacks.on_sent(self.peer.instance_id, item.transfer_id, (item.layer_index,))
            self._write_direct(sock, direct)

    def _batch(self, first: SendItem) -> tuple[list[SendItem], bool]:
        """``first`` and the layers queued behind it; True when the stop marker came up (after the
        batch). Unbounded: the caller queued them, the receiver is told of written layers every
        ``ANNOUNCE_S``, and a revoke waits for one layer at most (:class:`GrantView`)."""
        batch = [first]
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return batch, False
            if item is None:
                return batch, True
            batch.append(item)

    def _write_direct(self, sock: socket.socket, layers: list[tuple[SendItem, ShmDest]]) -> None:
        """Copy layers of one transfer (one grant) straight into the receiver's granted blocks under
        one hold of the grant's lock, announcing them (DONE frames, reported sent) every
        ``ANNOUNCE_S`` and at the end. A layer whose runs do not fit fails its transfer; a revoked
        grant drops the layers not yet copied.

        One hold for the batch, not one per layer: each lock and unlock is a system call, where
        the writer lets go of the GIL and waits to get it back from the process's other threads
        (docs/decisions/111-shm-one-hold.md)."""
        if not layers:
            return
        assert self._grants is not None
        grant = layers[0][1]
        frames: list[bytes] = []
        done: list[int] = []
        announce_at = time.monotonic() + ANNOUNCE_S
        try:
            with self._grants.holding(grant.slot, grant.token, CANCEL_WAIT_S * 5) as granted:
                for item, dest in layers:
                    if not granted() or self.plane.is_cancelled(item.transfer_id):
                        return  # revoked: the receiver's blocks may be in use again
                    try:  # planned here, not for the batch up front: the first copy starts sooner
                        src, dst, runs = self._plan(item, dest)
                    except ValueError as exc:
                        self.plane.callbacks.on_transfer_failed(
                            item.transfer_id, f"mismatch: shared-memory layer {item.layer_index}: {exc}"
                        )
                        continue
                    self._copy(item.layer_index, src, dst, runs)
                    tid = item.transfer_id.encode()
                    total = _payload_bytes(item)  # the runs' total (pairing checked it)
                    frames.append(
                        FRAME.pack(Frame.DONE, item.layer_index, total, 0, 0, total, len(tid)) + tid
                    )
                    done.append(item.layer_index)
                    if time.monotonic() >= announce_at:
                        self._announce(sock, grant.transfer_id, frames, done)
                        announce_at = time.monotonic() + ANNOUNCE_S
        except TimeoutError as exc:
            raise ConnectionError(f"receiver kept its grant table locked: {exc}") from exc
        finally:  # what was written is announced, also when a later layer was revoked
            self._announce(sock, grant.transfer_id, frames, done)

    def _copy(self, layer: int, src: Bytes, dst: Bytes, runs: list[Run]) -> None:
        """One layer's runs into the granted destination; with the test hook set for ``layer``
        (``plane.STOP_MID_LAYER_ENV``) this process stops itself half way (SIGSTOP) and writes the
        rest once resumed: a sender stalled in the middle of a layer."""
        if layer != self.plane.stop_mid_layer:
            self.plane.copier.copy(src, dst, runs)
            return
        first, rest = halves(runs)
        self.plane.copier.copy(src, dst, first)
        # thread-directed: this thread stops on its way out of the system call (a SIGSTOP sent to
        # the process may be taken by another thread while this one copies on until a tick)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        self.plane.copier.copy(src, dst, rest)
        self._count("stopped_mid_layer")

    def _announce(
        self, sock: socket.socket, transfer_id: str, frames: list[bytes], layers: list[int]
    ) -> None:
        """Send the DONE frames of written ``layers`` and report them sent; empties both lists
        (first: a link that breaks meanwhile does not see them announced twice)."""
        if not frames:
            return
        data, sent = b"".join(frames), tuple(layers)
        frames.clear()
        layers.clear()
        self._count("one_copy", len(sent))  # before the frames: the layers may complete
        sock.sendall(data)
        self.plane.callbacks.on_sent(self.peer.instance_id, transfer_id, sent)

    def _plan(self, item: SendItem, dest: ShmDest) -> tuple[Bytes, Bytes, list[Run]]:
        """(source bytes, destination bytes, runs) of a one-copy layer; ValueError when they do not fit."""
        src_spans: Sequence[tuple[int, int]]
        if item.spans is not None:
            src, src_spans = self._sources.of(item.spans.base), item.spans.spans
        else:
            tensor = item.tensor if item.tensor.device.type == "cpu" else item.tensor.cpu()
            src = tensor_array(tensor)  # maybe a temporary copy: not kept
            src_spans = ((0, src.size),)
        region = self._regions.arrays[dest.region]
        if not 0 <= dest.base <= region.size:
            raise ValueError(f"destination base {dest.base} outside the region ({region.size} B)")
        dst = region[dest.base :]
        return src, dst, self._plans.runs(src_spans, dest.spans, src.size, dst.size)

    def _write(self, sock: socket.socket, ring: Bytes, item: SendItem) -> None:
        if item.spans is not None:
            cursor = SpanCursor(tensor_array(item.spans.base), item.spans.spans)
        else:
            tensor = item.tensor if item.tensor.device.type == "cpu" else item.tensor.cpu()
            flat = tensor_array(tensor)
            cursor = SpanCursor(flat, [(0, flat.size)])
        tid = item.transfer_id.encode()
        size = ring.size
        chunk_max = min(CHUNK_BYTES, size // 4)
        total = cursor.total
        while True:
            n = min(chunk_max, cursor.remaining())
            pos = self._reserve(sock, n, size)
            if self.plane.is_cancelled(item.transfer_id):
                raise _Cancelled
            layer_off = cursor.pos
            cursor.gather(ring, pos % size, n)
            if cursor.remaining() == 0:
                self._count("ring")
            sock.sendall(FRAME.pack(Frame.CHUNK, item.layer_index, total, layer_off, pos, n, len(tid)) + tid)
            self._head = pos + n
            if cursor.remaining() == 0:
                return

    def _count(self, path: str, layers: int = 1) -> None:
        with self.plane.lock:
            self.plane.layers_sent[path] += layers

    def _reserve(self, sock: socket.socket, num_bytes: int, size: int) -> int:
        """Ring position for the next chunk, once the receiver has freed enough (waits for credit).
        Credits are drained before every chunk, not only when the ring is full: many small layers
        would otherwise fill the socket with unread credits until the receiver blocks writing one
        while this side blocks writing a frame."""
        self._read_credit(sock, wait=False)
        pos = next_slot(self._head, num_bytes, size)
        timeout_s = self.plane.config.links.link_timeout_s
        deadline = time.monotonic() + timeout_s
        while pos + num_bytes - self._consumed > size:
            if self.stopped.is_set():
                raise ConnectionError("plane closing")
            consumed = self._consumed
            self._read_credit(sock, wait=True)
            if self._consumed != consumed:
                deadline = time.monotonic() + timeout_s  # progress: the receiver is copying out
            elif time.monotonic() > deadline:
                raise TimeoutError(f"the receiver returned no ring credit for {timeout_s:g} s")
        return pos

    def _read_credit(self, sock: socket.socket, wait: bool) -> None:
        readable, _, _ = select.select([sock], [], [], POLL_S if wait else 0)
        if not readable:
            return
        data = sock.recv(4096)
        if not data:
            raise ConnectionError("receiver closed the shared-memory link")
        buf = self._credit_buf + data
        whole = len(buf) - len(buf) % CREDIT.size
        if whole:
            self._consumed = max(self._consumed, CREDIT.unpack_from(buf, whole - CREDIT.size)[0])
        self._credit_buf = buf[whole:]

    def _finish(self) -> None:
        with self.plane.lock:
            self.dead = True
            if self.plane.outbound.get(self.peer.instance_id) is self:
                del self.plane.outbound[self.peer.instance_id]
        if self.sock is not None:
            self.sock.close()
        if self._ring is not None:
            with contextlib.suppress(BufferError):  # a numpy view may still be alive: GC unmaps then
                self._ring.close()
        self._regions.close()  # the receiver's KV cache: unmapped with the peer epoch
        if self._grants is not None:
            self._grants.close()
        if not self.stopped.is_set():
            fail_queued(self.queue, self.plane.callbacks, "peer_lost: shared-memory link closed")
