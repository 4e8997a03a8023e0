"""The one-copy path's pieces without sockets: grant messages, a peer's mapped regions, the copier.

When a receiver's destination lies in a :mod:`shared region <kvwire.transfer.shared_memory>`, its
grant describes it as (region id, byte spans from the region's base, grant slot and token) and the
sender, which mapped the region at link setup, copies its blocks straight into it: the block runs
are paired (``planes.ipc.runs.pair_runs``: runs contiguous on both sides merge) and copied by
:class:`RunCopier` with the GIL released, split over ``threads`` so that the per-run Python cost of
one thread overlaps the other's ``memcpy``.
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

from kvwire.transfer.planes.ipc.runs import Run, pair_runs
from kvwire.transfer.shared_memory import check_peer_memfd

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
    except msgspec.DecodeError as exc:
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
    """A layer plan's runs, with the slice pairs of the copy loop made once for every layer that
    reuses the plan (about 30 ns a run less than slicing by offsets in the loop)."""

    @functools.cached_property
    def slices(self) -> list[tuple[slice, slice]]:
        """(source slice, destination slice) per run."""
        return [(slice(s, s + n), slice(d, d + n)) for s, d, n in self]


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


def check_runs(runs: Sequence[Run], src_size: int, dst_size: int) -> None:
    """Raises ValueError when a run leaves its source or destination."""
    for s, d, n in runs:
        if s < 0 or d < 0 or s + n > src_size or d + n > dst_size:
            raise ValueError(f"run ({s}, {d}, {n}) outside the source ({src_size}) or region ({dst_size})")


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


class RunCopier:
    """Copies byte runs ``dst[d:d+n] = src[s:s+n]`` (flat ``uint8`` arrays). Stop with :meth:`close`.

    One thread (the default): ``memoryview`` slice assignment on the caller's thread, the cheapest
    per-run dispatch from Python (about 0.2 us against 1 us for a numpy slice; a KV block half is
    one run of 32 KiB); it holds the GIL during each memcpy. More threads: the runs are cut into
    ``threads`` pieces of about equal bytes, copied by numpy on the caller's thread and
    ``threads - 1`` helpers (numpy releases the GIL for each copy, so copies overlap each other's
    Python). Which is faster depends on the cores free: ``kvwire bench transfer --backend shm
    --shm-copy-threads N`` measures it (docs/performance.md).
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
        if self._pool is None or len(runs) < self._MIN_SPLIT:
            _copy_views(src, dst, runs)
            return
        parts = _split(runs, self.threads)
        futures: list[Future[None]] = [self._pool.submit(_copy, src, dst, part) for part in parts[1:]]
        try:
            _copy(src, dst, parts[0])
        finally:
            for future in futures:
                future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _copy_views(src: Bytes, dst: Bytes, runs: Sequence[Run]) -> None:
    pairs = runs.slices if isinstance(runs, PlannedRuns) else PlannedRuns(runs).slices
    with src.data as s_view, dst.data as d_view:  # released here: the mmaps can close
        for s_slice, d_slice in pairs:
            d_view[d_slice] = s_view[s_slice]


def _copy(src: Bytes, dst: Bytes, runs: Sequence[Run]) -> None:
    for s, d, n in runs:
        dst[d : d + n] = src[s : s + n]


def _split(runs: Sequence[Run], parts: int) -> list[Sequence[Run]]:
    """``runs`` cut into ``parts`` consecutive pieces of about equal bytes."""
    total = sum(n for _, _, n in runs)
    out: list[Sequence[Run]] = []
    start, acc, share = 0, 0, total / parts
    for i, (_, _, n) in enumerate(runs):
        acc += n
        if acc >= share * (len(out) + 1) and len(out) < parts - 1:
            out.append(runs[start : i + 1])
            start = i + 1
    out.append(runs[start:])
    return out
