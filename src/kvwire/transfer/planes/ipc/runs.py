"""Pure bookkeeping of the IPC plane (no CUDA): pairing source and destination byte runs and cutting
them into tiles, the Grant's destination messages, and which allocations were imported from which
peer epoch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

Run = tuple[int, int, int]  # (source byte offset, destination byte offset, bytes)


def pair_runs(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> list[Run]:
    """Copies that move the concatenation of ``src`` spans into the ``dst`` spans, in order: one run
    per stretch that is contiguous on both sides (adjacent block runs merge, so a request whose
    blocks are consecutive on both ends is one copy). Raises ValueError when the totals differ."""
    if sum(n for _, n in src) != sum(n for _, n in dst):
        raise ValueError(
            f"source spans hold {sum(n for _, n in src)} bytes, destination {sum(n for _, n in dst)}"
        )
    runs: list[Run] = []
    si = di = 0
    s_done = d_done = 0  # bytes used of the current source / destination span
    src_l = [s for s in src if s[1] > 0]
    dst_l = [d for d in dst if d[1] > 0]
    while si < len(src_l) and di < len(dst_l):
        s_off, s_len = src_l[si]
        d_off, d_len = dst_l[di]
        n = min(s_len - s_done, d_len - d_done)
        a, b = s_off + s_done, d_off + d_done
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((a, b, n))
        s_done += n
        d_done += n
        if s_done == s_len:
            si, s_done = si + 1, 0
        if d_done == d_len:
            di, d_done = di + 1, 0
    return runs


def spans_array(spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``(offset, bytes)`` spans as an ``(N, 2)`` int64 array."""
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def tile_runs(src: np.ndarray, dst: np.ndarray, tile_bytes: int) -> np.ndarray:
    """The ``(src_offset, dst_offset, bytes)`` tiles (``(T, 3)`` int64, each at most ``tile_bytes``)
    that move the concatenation of ``src`` spans into the ``dst`` spans (both ``(N, 2)`` arrays of
    one layer, offsets relative to its base). Stretches contiguous on both sides merge first, so
    consecutive blocks become full tiles. Vectorized when the spans pair one to one (every block of
    one size, the usual case); any other pairing goes through :func:`pair_runs`."""
    if src.shape == dst.shape and np.array_equal(src[:, 1], dst[:, 1]):
        runs = np.column_stack((src[:, 0], dst[:, 0], src[:, 1]))
    else:
        pairs = pair_runs([(int(o), int(n)) for o, n in src], [(int(o), int(n)) for o, n in dst])
        runs = np.asarray(pairs, dtype=np.int64).reshape(-1, 3)
    runs = runs[runs[:, 2] > 0]
    if len(runs) == 0:
        return runs
    # merge stretches contiguous on both sides
    ends = runs[:-1, :2] + runs[:-1, 2:3]
    starts = np.ones(len(runs), dtype=bool)
    starts[1:] = ~np.all(ends == runs[1:, :2], axis=1)
    first = np.flatnonzero(starts)
    runs = np.column_stack((runs[first, 0], runs[first, 1], np.add.reduceat(runs[:, 2], first)))
    # cut into tiles
    counts = -(-runs[:, 2] // tile_bytes)
    owner = np.repeat(np.arange(len(runs)), counts)
    index_in_run = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    shift = index_in_run * tile_bytes
    lengths = np.minimum(runs[owner, 2] - shift, tile_bytes)
    return np.column_stack((runs[owner, 0] + shift, runs[owner, 1] + shift, lengths))


class Dest(msgspec.Struct, array_like=True, frozen=True):
    """Where one granted layer goes: an exported allocation, the layer's base as an offset into it,
    and which of the Grant's span sets holds its byte spans (relative to that base)."""

    transfer_id: str
    layer: int
    handle: bytes  # CUDA IPC memory handle of the allocation (64 bytes); b"": not device memory
    shift: int  # the layer's base - the allocation's base
    span_set: int  # index into GrantInfo.span_sets


class GrantInfo(msgspec.Struct, frozen=True):
    """The receiver's plane_info on a Grant: destinations of the layers it just posted. Layers
    granted together usually share one span set (the same block ids in caches of one geometry):
    each set travels once, as the bytes of an ``(N, 2)`` little-endian int64 array."""

    dests: list[Dest]
    span_sets: list[bytes]

    def arrays(self) -> list[np.ndarray]:
        return [np.frombuffer(b, dtype="<i8").reshape(-1, 2) for b in self.span_sets]


@dataclasses.dataclass(frozen=True)
class Target:
    """A granted layer as the sender uses it: the allocation's handle, the layer's base within it,
    its byte spans relative to that base (``(N, 2)``; shared by the layers of one span set)."""

    handle: bytes
    shift: int
    spans: np.ndarray


@dataclasses.dataclass
class ImportTable:
    """Allocations of peers mapped into this process: handle -> mapped base address, per peer epoch.
    ``open_fn`` maps a handle, ``close_fn`` unmaps; each handle is opened once per peer epoch (CUDA
    refuses to map one allocation twice in a process) and closed when the peer goes away."""

    open_fn: Callable[[bytes], int]
    close_fn: Callable[[int], None]
    by_peer: dict[str, dict[bytes, int]] = dataclasses.field(default_factory=dict)

    def address(self, peer_id: str, handle: bytes) -> int:
        mapped = self.by_peer.setdefault(peer_id, {})
        if handle not in mapped:
            mapped[handle] = self.open_fn(handle)
        return mapped[handle]

    def close_peer(self, peer_id: str) -> int:
        """Unmap everything of ``peer_id``; returns how many mappings were closed."""
        mapped = self.by_peer.pop(peer_id, {})
        for address in mapped.values():
            self.close_fn(address)
        return len(mapped)

    def close_all(self) -> None:
        for peer_id in list(self.by_peer):
            self.close_peer(peer_id)
