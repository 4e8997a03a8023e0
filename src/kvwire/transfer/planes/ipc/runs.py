"""Pure bookkeeping of the IPC plane (no CUDA): pairing source and destination byte runs, the
handshake messages, and which allocations were exported to / imported from which peer epoch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import msgspec

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


class Dest(msgspec.Struct, array_like=True, frozen=True):
    """Where one granted layer goes: an exported allocation and byte spans relative to its base."""

    transfer_id: str
    layer: int
    handle: bytes  # CUDA IPC memory handle of the allocation (64 bytes)
    spans: list[tuple[int, int]]  # (offset from the allocation base, bytes)


class GrantInfo(msgspec.Struct, frozen=True):
    """The receiver's plane_info on a Grant: destinations of the layers it just posted."""

    dests: list[Dest]


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
