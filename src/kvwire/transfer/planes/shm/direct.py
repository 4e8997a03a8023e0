"""The one-copy path's pieces without sockets: grant messages, a peer's mapped regions, the copier.

When a receiver's destination lies in a :mod:`shared region <kvwire.transfer.shared_memory>`, its
grant describes it as (region id, byte spans from the region's base, grant slot and token) and the
sender, which mapped the region at link setup, copies its blocks straight into it: the block runs
are paired (``planes.common.runs.pair_runs``: runs contiguous on both sides merge) and copied by
:class:`RunCopier` (:mod:`run_copy <kvwire.transfer.planes.shm.run_copy>`: one native call per layer,
without the GIL), optionally split over several threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from kvwire.transfer.memory import check_peer_memfd
from kvwire.transfer.planes.common.runs import Run, pair_runs
from kvwire.transfer.planes.shm.run_copy import STREAM_MIN_BYTES, check_table, copy_runs, run_table

Bytes = npt.NDArray[np.uint8]


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
    """The copies moving the ``src`` spans' bytes into the ``dst`` spans (``pair_runs``), with a
    fast path for the common case of paged -> paged (span i of each side has the same length: block
    runs that are contiguous on both sides are single spans already). Raises ValueError when the
    totals differ."""
    if len(src) == len(dst) and all(a[1] == b[1] for a, b in zip(src, dst, strict=True)):
        return [(a[0], b[0], a[1]) for a, b in zip(src, dst, strict=True) if a[1] > 0]
    return pair_runs(src, dst)


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
