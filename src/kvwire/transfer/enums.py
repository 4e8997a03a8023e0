"""The transfer package's torch-free vocabulary: which plane, why a transfer failed, how a KV cache
is laid out. Importable by configs, the CLI and the vLLM plugin's config without torch."""

from __future__ import annotations

import enum


class Backend(str, enum.Enum):
    """Which data plane moves the bytes. The control plane is always ZMQ."""

    TCP = "tcp"  # raw loopback/LAN sockets, CPU tensors (kvwire.transfer.planes.tcp.plane)
    NCCL = "nccl"  # NCCL point to point between GPUs (kvwire.transfer.planes.nccl.plane)
    SHM = "shm"  # shared-memory ring between two processes of one host, CPU tensors (planes.shm)
    IPC = "ipc"  # CUDA IPC: the peer's KV memory mapped, copy engines, one host (planes.ipc)


class Transport(str, enum.Enum):
    """``--kv-transport``: which plane a pair of agents uses. ``auto`` negotiates per peer at first
    contact (ipc > shm > nccl > tcp, among the planes both ends hold and can use together); any other
    value forces that plane, and a pair that cannot use it fails its transfers with ``transport``."""

    AUTO = "auto"
    IPC = "ipc"
    SHM = "shm"
    NCCL = "nccl"
    TCP = "tcp"


class FailReason(str, enum.Enum):
    """Why a transfer failed (the prefix of the reason string in ``TransferEvents.failed``;
    also the label of the ``failed`` counter in :class:`TransferStats`)."""

    ABORTED = "aborted"  # local abort(...)
    PEER_ABORTED = "peer_aborted"  # the other side aborted (or closed)
    DEADLINE = "deadline"  # deadline passed before every layer was acknowledged
    PEER_LOST = "peer_lost"  # data connection broke, or the peer restarted (new instance id)
    BUDGET = "budget"  # can never fit in receive budget + spill pool
    MISMATCH = "mismatch"  # expect(num_layers) disagrees with the sender's offer, bad sizes...
    UNKNOWN = "unknown_transfer"  # pull for a transfer the sender does not hold
    CLOSED = "closed"  # the local agent closed
    SINK = "sink"  # the caller's sink raised
    TRANSPORT = "transport"  # the pair cannot use the forced --kv-transport (names both ends)
    REFUSED = "refused"  # offered by another agent than the one the transfer is bound to
    OTHER = "other"  # a reason without a known prefix (never produced by the agent itself)

    @classmethod
    def of(cls, reason: str) -> FailReason:
        """The kind of a failure reason string: every reason the agent reports starts with its
        kind's value (``"deadline: 3/32 layers acknowledged"``); anything else is ``OTHER``."""
        head = reason.split(":", 1)[0].strip()
        try:
            return cls(head)
        except ValueError:
            return cls.OTHER

    def says(self, detail: str) -> str:
        """``"<kind>: <detail>"`` (the detail unchanged when it already names a kind)."""
        if FailReason.of(detail) is not FailReason.OTHER:
            return detail
        return f"{self.value}: {detail}"


class KVLayout(str, enum.Enum):
    KV_FIRST = "kv_first"  # [2, num_blocks, block_size, H, D]
    BLOCK_FIRST = "block_first"  # [num_blocks, 2, block_size, H, D]
    MLA = "mla"  # [num_blocks, block_size, dim]
    BLOCK_HEAD = "block_head"  # [num_blocks, H, rest, C]: each (block, head) one run (vLLM's CPU cache)
