"""The grant table: how a receiver revokes a sender's right to write into its shared KV cache.

On the one-copy path the *sender* writes into the receiver's blocks, so the receiver's ``cancel``
cannot simply stop copying (as it does on the ring path): it must be sure that no write of the
cancelled transfer is under way or can start later, before the caller reuses those blocks.

The table is a small memfd of 64-bit tokens, one slot per granted transfer, shared with one
sending peer (passed at its links' setup; each peer has a table of its own: :mod:`regions`). A
grant names (slot, token). The sender holds a byte-range lock on the slot (an
open-file-description lock, ``F_OFD_SETLK``: per descriptor, so two threads of one process exclude
each other too, and the kernel drops it when a holder dies) while it copies the layers queued for
the transfer, and re-reads the token before each layer. The receiver revokes by zeroing the token
and then taking the same lock: once that returns, nothing of the transfer is being written and
nothing will be. A sender that read the token before it was zeroed finishes the layer under way,
sees the zero before the next one and lets go, so a revoke waits for at most one layer's copy
however many layers the sender holds the slot for. The lock is what guarantees exclusion (a stale
read of the token only delays the sender's stop; the revoke still waits for the lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import struct
import time
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt

from kvwire.transfer.memory import check_peer_memfd, sealed_memfd

SLOT_BYTES = 8
DEFAULT_SLOTS = 4096  # transfers with one-copy grants outstanding at once (more: they use the ring)
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


class GrantTable:
    """One grant region of the receiver (one per sending peer): claims slots for transfers and
    revokes them."""

    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        self.fd = sealed_memfd("kvwire-shm-grants", slots * SLOT_BYTES)
        try:
            self._map = mmap.mmap(self.fd, slots * SLOT_BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self.tokens: npt.NDArray[np.uint64] = np.frombuffer(self._map, dtype=np.uint64)
        self.size = slots * SLOT_BYTES
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))

    def claim(self) -> tuple[int, int] | None:
        """A free slot armed with a new token: (slot, token); None when every slot is in use.
        Caller serializes (the plane's lock)."""
        if not self._free:
            return None
        slot = self._free.pop()
        token = secrets.randbits(63) | 1
        self.tokens[slot] = token
        return slot, token

    def in_use(self) -> int:
        """Slots claimed and not freed yet (granted, or waiting for a sender to let go)."""
        return self.slots - len(self._free)

    def revoke(self, slot: int, timeout_s: float) -> bool:
        """Zero the slot's token, then take its lock and free the slot: True once no sender writes
        under it any more; False when a sender held the lock past ``timeout_s`` (no new write
        starts, but one may still be running; the slot stays out of use until :meth:`try_release`
        succeeds). Zeroing first tells a sender holding the lock across layers to stop after the
        layer it is copying. ``timeout_s`` 0: one try, no wait."""
        self.tokens[slot] = 0
        held = lock_slot(self.fd, slot, timeout_s)
        if held:
            unlock_slot(self.fd, slot)
            self._free.append(slot)
        return held

    def try_release(self, slot: int) -> bool:
        """A slot whose revoke timed out (its token is zero already): take its lock without waiting
        and free the slot. True when nobody holds it any more: its sender let go, or its process
        ended (the kernel drops a dead holder's lock), so nothing writes under the grant again."""
        if not _lock(self.fd, slot, fcntl.F_WRLCK, wait=False):
            return False
        unlock_slot(self.fd, slot)
        self._free.append(slot)
        return True

    def close(self) -> None:
        del self.tokens
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)


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
