"""Pure bookkeeping of the IPC plane (no CUDA): the Grant's destination messages, and which
allocations were imported from which peer epoch (the copy runs themselves:
:mod:`kvwire.transfer.planes.common.runs`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import msgspec
import numpy as np


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
