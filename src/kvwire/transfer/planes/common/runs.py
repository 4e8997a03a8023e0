"""Copy runs between byte spans (no CUDA, no torch): pairing source and destination spans into runs
that are contiguous on both sides, and cutting them into tiles. The shared-memory plane's one-copy
path and the CUDA IPC plane's copies both plan with these."""

from __future__ import annotations

from collections.abc import Sequence

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
