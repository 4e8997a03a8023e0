"""Per-peer plane negotiation: what each agent says about itself, and the pair's choice.

Every control message that carries ``plane_info`` (Offer, Grant, Pull) starts with this agent's
:class:`Hello`: host identity (boot id + hostname + network namespace inode: two processes share
memory and abstract Unix sockets only when all three match), device kind and GPU UUID, the planes it
holds (with their addresses) and the transport it was forced to, if any. Both ends run
:func:`choose` on the same two hellos, so they agree without another round trip: the receiver knows
the sender's hello from the Offer before it posts a receive, and the sender learns the receiver's
from the first Grant before it sends a byte. Pure logic (no torch): unit-tested on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket

import msgspec

from kvwire.errors import ProtocolError
from kvwire.transfer.enums import Backend, Transport

#: Preference of the pair when nothing is forced: same-host planes first (no wire at all), then
#: NCCL (GPU to GPU), then TCP (anything to anything).
PREFERENCE: tuple[Backend, ...] = (Backend.IPC, Backend.SHM, Backend.NCCL, Backend.TCP)


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """One agent as its peers' planes need to know it (travels in every ``plane_info``)."""

    instance_id: str
    boot_id: str
    hostname: str
    netns: int  # inode of /proc/self/ns/net (0 when unknown: never equal to another's)
    device: str  # "cpu" or "cuda"
    gpu_uuid: str = ""  # the CUDA device's UUID ("" on CPU)
    peer_gpus: list[str] = []  # UUIDs of this host's other GPUs the device reaches peer to peer
    planes: dict[str, str] = {}  # backend value -> that plane's address, in preference order
    forced: str = ""  # the forced transport ("" = auto)

    def describe(self) -> str:
        gpu = f" {self.gpu_uuid}" if self.gpu_uuid else ""
        planes = ",".join(self.planes)
        return f"{self.hostname} (instance {self.instance_id[:8]}, {self.device}{gpu}, planes {planes})"


class Envelope(msgspec.Struct, frozen=True):
    """``plane_info`` of a plane set: the hello plus the member planes' own handshake bytes."""

    hello: Hello
    inner: dict[str, bytes] = {}  # backend value -> that plane's local_info for this peer


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_TRANSPORTS = frozenset(t.value for t in Transport)


def decode_envelope(info: bytes) -> Envelope:
    """A peer's ``plane_info`` -> :class:`Envelope`; ``ProtocolError`` for anything else (bytes that
    do not decode, nest too deep, or force a transport this version does not know)."""
    try:
        envelope = _envelope_decoder.decode(info)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"plane handshake does not decode: {exc}") from exc
    if envelope.hello.forced and envelope.hello.forced not in _TRANSPORTS:
        raise ProtocolError(f"plane handshake forces an unknown transport {envelope.hello.forced[:32]!r}")
    return envelope


@dataclasses.dataclass(frozen=True)
class Choice:
    """The pair's plane, or why there is none (``backend`` None: ``error`` names both ends)."""

    backend: Backend | None
    error: str = ""


@functools.cache
def host_identity() -> tuple[str, str, int]:
    """(boot id, hostname, network-namespace inode) of this process."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return boot_id, socket.gethostname(), netns


def same_host(a: Hello, b: Hello) -> bool:
    """Both processes share the host's memory and its abstract Unix sockets."""
    return (
        bool(a.boot_id)
        and a.netns != 0
        and (a.boot_id, a.hostname, a.netns) == (b.boot_id, b.hostname, b.netns)
    )


def usable(backend: Backend, a: Hello, b: Hello) -> str:
    """ "" when the pair can use ``backend``; otherwise why not."""
    if backend.value not in a.planes or backend.value not in b.planes:
        holders = [h.hostname + "/" + h.instance_id[:8] for h in (a, b) if backend.value in h.planes]
        return f"not held by both ends (held by: {', '.join(holders) or 'neither'})"
    if backend in (Backend.IPC, Backend.SHM) and not same_host(a, b):
        return "the two ends are not on the same host (boot id, hostname or network namespace differ)"
    if backend in (Backend.IPC, Backend.NCCL) and not (a.device == b.device == "cuda"):
        return f"needs CUDA tensors on both ends (devices {a.device} and {b.device})"
    if backend is Backend.IPC and not _reachable(a, b):
        return f"GPUs {a.gpu_uuid or '?'} and {b.gpu_uuid or '?'} are neither one device nor peer-accessible"
    if backend is Backend.SHM and not (a.device == b.device == "cpu"):
        return f"moves CPU tensors only (devices {a.device} and {b.device})"
    return ""


def _reachable(a: Hello, b: Hello) -> bool:
    """One GPU, or two that can access each other's memory (CUDA IPC maps the peer's allocation)."""
    if not a.gpu_uuid or not b.gpu_uuid:
        return False
    return a.gpu_uuid == b.gpu_uuid or (b.gpu_uuid in a.peer_gpus and a.gpu_uuid in b.peer_gpus)


def choose(local: Hello, remote: Hello) -> Choice:
    """The plane of the pair (symmetric: ``choose(a, b) == choose(b, a)``)."""
    forced = {h.forced for h in (local, remote) if h.forced and h.forced != Transport.AUTO.value}
    ends = f"{local.describe()} and {remote.describe()}"
    if len(forced) > 1:
        return Choice(None, f"transports {' and '.join(sorted(forced))} are forced on the two ends: {ends}")
    if forced:
        backend = Backend(forced.pop())
        why = usable(backend, local, remote)
        if why:
            return Choice(
                None, f"transport {backend.value!r} is forced but cannot be used between {ends}: {why}"
            )
        return Choice(backend)
    for backend in PREFERENCE:
        if not usable(backend, local, remote):
            return Choice(backend)
    return Choice(None, f"no data plane works between {ends}")
