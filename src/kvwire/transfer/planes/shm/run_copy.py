"""Copying byte runs ``dst[d:d+n] = src[s:s+n]`` between flat ``uint8`` arrays: the shared-memory
plane's one copy primitive (the one-copy path's block runs, the ring's chunks).

Native when the C extension ``_copy_runs`` is built (``pip install`` builds it wherever a C compiler
is found): one call per batch of runs, bounds checked in C, the copies without the GIL. Otherwise a
Python loop of ``memoryview`` slice assignments holding the GIL, slower (measured in
docs/decisions/112-native-run-copies.md) and logged once as a warning.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]
Run = tuple[int, int, int]  # (source offset, destination offset, bytes)

log = logging.getLogger("kvwire.transfer")

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


def describe() -> str:
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
