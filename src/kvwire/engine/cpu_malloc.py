"""glibc malloc settings for a process that runs a CPU engine (decision 152).

A prefill step allocates tens of MB per layer (a [2048, 3072] projection output is 25 MB) and frees
them before the next layer. With glibc's defaults where such a block comes from depends on the
process's history: above the dynamic mmap threshold it is mapped fresh and page-faulted on every call,
and a thread's arena heap that empties is unmapped (the server's engine runs on its own thread). On
SmolLM2 at 8 x 256 tokens that was 200k to 550k page faults and 0.3 to 0.8 s of system time per prefill
step for one model form and none for another, process to process. Fixed settings make every engine
process reuse its heap instead: blocks up to 32 MiB (glibc's largest threshold) come from the heap,
freed memory is kept (trim threshold 1 GiB) and an arena's heap keeps 64 MiB of pad, so it is not
unmapped when it empties. The cost: the process keeps its high-water mark of freed heap (up to
about 1 GiB more than it uses) instead of returning it to the system.

Applied once per process by :class:`~kvwire.engine.llm_engine.LLMEngine` on the CPU
(``EngineConfig.cpu_malloc_tuning``, default on; ``kvwire serve --no-cpu-malloc-tuning``
turns it off); a no-op where the C library has no ``mallopt``.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet


def tune_malloc() -> bool:
    """Set :data:`SETTINGS` through glibc's ``mallopt`` (once per process); whether they are in
    effect. False where the C library has no ``mallopt`` (musl, macOS) or refuses a value."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        log.info("malloc left at its defaults: the C library has no mallopt")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    refused = [param for param, value in SETTINGS if mallopt(param, value) != 1]
    if refused:
        log.warning("mallopt refused parameters %s: prefill buffers may be page-faulted every step", refused)
        return False
    log.info("malloc: mmap threshold 32 MiB, trim threshold 1 GiB, top pad 64 MiB (CPU engine, decision 152)")
    return True
