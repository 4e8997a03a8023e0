"""The data-plane interface: what a transport (TCP, NCCL) must do for the transfer agent.

Division of labour
------------------
The :class:`~kvwire.transfer.agent.TransferAgent` owns everything that is *control*: the ZMQ control
plane (offer / grant / ack / abort / pull messages), per-transfer state, deadlines, aborts, peer
epochs (instance ids), the receive budget + spill pool, credits (grants) and the ``poll()`` events.
A :class:`DataPlane` only moves the bytes of layers that the agent has already matched up:

* sender side: the agent calls :meth:`DataPlane.send` with layers that the receiver has **granted**
  (credit = a destination buffer already reserved on the receiver) and that are **ready**
  (``send_layer`` was called). The plane moves them and calls ``callbacks.on_sent``.
* receiver side: the agent calls :meth:`DataPlane.post_recv` with the destination buffer of every
  layer it grants (before the GRANT message leaves, so a fast sender never finds no posted buffer;
  the NCCL plane only queues the receive there and posts it on its own thread, since posting may
  wait on the GPU and a NCCL send waits on the GPU for its receive anyway).
  The plane fills ``dest`` and calls ``callbacks.on_received``.
* completion is the agent's business: the receiver acknowledges received layers on the control
  plane and the sender's transfer finishes when every layer is acknowledged.

Message flow (push mode; pull mode starts with the receiver's PULL, then the same)::

    sender agent                                  receiver agent
    start_send ── OFFER(layers, plane_info) ──────> (expect before or after)
                                                   reserve budget/spill, plane.post_recv(items)
               <── GRANT(layer ids, data_address, plane_info)
    plane.send(granted & ready layers) ═══ bytes ═══> plane fills dest; on_received
               <── ACK(layer ids)  (coalesced)      sink(layer, tensor) or buffered
    finished_sending when all acked               finished_recving when all arrived (+ trailer)

Peers: every control message carries the sender's instance id. The agent builds a :class:`PeerRef`
(endpoint, instance_id, data_address, plane_info) for each peer epoch and passes it to the plane. A
new instance id at a known endpoint means the old process is gone: the agent calls
:meth:`DataPlane.drop_peer` for the old one and fails its transfers.

Handshake data (e.g. an NCCL unique id): before sending OFFER, GRANT or PULL to a peer the agent
calls :meth:`DataPlane.local_info` and puts the returned bytes in the message's ``plane_info`` field;
on receiving a message with non-empty ``plane_info`` it calls :meth:`DataPlane.on_peer_info`. Both
run on the agent's control thread and must not block (start slow work such as
``ncclCommInitRank`` on a plane thread, and fail it through ``on_peer_failed`` if it does not finish).

Ordering: a plane with ``ordered = True`` (NCCL: matched send/recv posted in the same order on both
ends) gets, per peer, ``post_recv`` items in grant order on the receiver and ``send`` items in exactly
the same order on the sender (the agent holds later granted layers until earlier ones are ready).
An unordered plane (TCP: every frame names its transfer and layer) gets layers as soon as they are
granted and ready, in any order.

Threads and callbacks: :meth:`send`, :meth:`post_recv`, :meth:`cancel`, :meth:`drop_peer` are called
from agent threads (control thread or a caller thread, with the agent lock held) and must return
without waiting on the network; the one exception is :meth:`cancel`, which may wait a bounded time
for a receive that is writing into the caller's memory (TCP: ``tcp_wire.CANCEL_WAIT_S``, then it
cuts the connection). ``callbacks`` are invoked from plane threads; they are thread-safe and cheap, except
``on_received`` which may run the caller's sink (a scatter) before returning — the plane must not
reuse ``dest`` until ``on_received`` returns. A plane never raises out of its threads: transport
failures become ``on_peer_failed(instance_id, reason)`` (the agent fails every transfer with that
peer epoch) and a failure that concerns a single transfer becomes ``on_transfer_failed``.

Cancellation: after ``cancel(transfer_id)`` the agent ignores callbacks for that transfer. The plane
drops queued sends/posted receives of it where it can; bytes already on the wire may still land in
the old ``dest`` (the plane holds the tensor reference, so this is memory-safe). An ordered plane
that cannot unpost a receive may instead complete it into the old buffer, or drop the peer.

Memory: receive-budget buffers come from :meth:`allocate` (a GPU plane allocates on its receive
stream); spill buffers are host memory (pinned on CUDA) allocated by the agent. A GPU plane given a
host ``dest`` stages through device memory. ``dest`` is a flat ``uint8`` tensor of ``num_bytes``.

Implementations: one subpackage per plane under :mod:`kvwire.transfer.planes` (``tcp``, ``shm``,
``ipc``, ``nccl``), built by :func:`kvwire.transfer.planes.factory.make_plane`, which imports them
lazily (this module imports none of them: no import circle).

This module holds the interface and everything about *which* plane moves a peer's bytes, in the
order a reader meets them (docs/decisions/139-planes-in-few-modules.md):

1. the interface: :class:`PlaneCallbacks`, :class:`DataPlane`;
2. negotiation: the :class:`Hello` each agent sends and the pair's :func:`choose`;
3. :class:`PlaneSet`: every held plane behind one :class:`DataPlane`, routed per peer epoch;
4. the bases of the socket planes: :class:`ListenerPlane` (tcp, shm, ipc) and
   :class:`UnixLinkPlane` (shm, ipc).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgspec
import torch

from kvwire.errors import ProtocolError
from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend, FailReason, Transport
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.common.admission import Admission, accept_loop, start_reader, unix_peer
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.common.wire import CANCEL_MEMORY_S, POLL_S, abstract_name, shutdown

log = logging.getLogger("kvwire.transfer")


class PlaneCallbacks(Protocol):
    """How a plane reports back to the agent (implemented by the agent; thread-safe)."""

    def on_sent(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        """These layers' bytes left this process (their source tensors may be reused by the plane).
        A plane that moves several layers as one message reports them in one call."""

    def on_received(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        """``dest`` of each of these layers' posted receives is completely filled (and synchronized,
        on a GPU). One call per message: the plane's thread holds the GIL once per message, not once
        per layer (on the NCCL plane a message carries up to dozens of layers)."""

    def on_transfer_failed(self, transfer_id: str, reason: str) -> None:
        """One transfer cannot continue (e.g. a frame of the wrong size)."""

    def on_peer_failed(self, peer_instance_id: str, reason: str) -> None:
        """The connection/communicator with that peer epoch broke: every transfer with it fails."""

    def on_protocol_error(self, reason: str) -> None:
        """Something unexpected arrived (unauthenticated connection, unknown frame): counted, logged."""

    def peer_endpoint(self, peer_instance_id: str) -> str | None:
        """The control endpoint where the control plane authenticated this peer epoch and still holds
        it as that endpoint's current one; None when it holds no such epoch (never heard, restarted
        since, forgotten). A data link's hello is accepted only from such an epoch (decision 126)."""

    def on_device_copy(self, num_bytes: int, seconds: float) -> None:
        """A plane that copies on the GPU itself (CUDA IPC) ran ``num_bytes`` of copies in ``seconds``
        of device time (the copy engine's speed, without the host's share of the transfer)."""


class DataPlane(abc.ABC):
    """Moves layer bytes between two agents. See the module docstring for the full contract."""

    #: True when sends and receives with one peer must be posted in the same order on both ends.
    ordered: ClassVar[bool] = False
    #: True when the plane moves ``SendItem.spans`` / ``RecvItem.dest_spans`` itself (zero-copy
    #: gather/scatter). Otherwise the agent gathers/scatters with copies and never passes spans.
    supports_spans: ClassVar[bool] = False
    #: True when a receiver may post and grant a transfer's spans before the sender's Offer (an
    #: early grant, decision 110): the plane checks that what is written fits what was granted.
    early_grants: ClassVar[bool] = False
    #: True when the plane runs ``RecvItem.on_device`` consumers on the GPU right behind the receive
    #: (:data:`kvwire.transfer.memory.DeviceConsumer`): no host wake-up between data and consumer.
    supports_device_consumers: ClassVar[bool] = False
    #: True when the plane runs ``SendItem.on_device`` producers on its send stream right before each
    #: message (:data:`kvwire.transfer.memory.DeviceProducer`).
    supports_device_producers: ClassVar[bool] = False
    #: True when the plane honours ``SendItem.ready_signal`` (a device-side wait before the sends).
    supports_device_signals: ClassVar[bool] = False

    @abc.abstractmethod
    def start(self, callbacks: PlaneCallbacks) -> None:
        """Bind/listen and start the plane's threads. Called once, before any other method."""

    #: what :attr:`address` returns, made once by ``start`` (a plane that derives it otherwise
    #: overrides :attr:`address`)
    _address: str = ""

    @property
    def address(self) -> str:
        """What peers need to reach this plane (TCP: "host:port"); sent in OFFER/GRANT messages."""
        assert self._address, "start() first"
        return self._address

    def local_info(self, peer: PeerRef) -> bytes:
        """Opaque handshake bytes for the next control message to ``peer`` (default: none)."""
        del peer
        return b""

    def on_peer_info(self, peer: PeerRef, info: bytes) -> None:
        """``peer`` sent handshake bytes (non-empty ``plane_info``). Must not block."""
        del peer, info

    def for_peer(self, peer: PeerRef) -> DataPlane:
        """The plane that moves data with ``peer``: its flags (``supports_spans``, device
        producers/consumers) say which items it takes, and a GPU plane's ``allocate_zero_copy`` is
        reached through it. This plane itself, except for a set of planes routing per peer."""
        del peer
        return self

    def register_memory(self, tensors: Sequence[torch.Tensor]) -> None:
        """Memory this agent receives into again and again (the registered KV caches): a plane may
        prepare to share it with peers (the shared-memory plane exports shared regions). Default:
        nothing. Called on the caller's thread, before transfers into it."""
        del tensors

    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A flat ``uint8`` receive buffer in the receive budget (on the plane's device)."""
        return torch.empty(num_bytes, dtype=torch.uint8)

    @abc.abstractmethod
    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        """Queue granted, ready layers for ``peer``; returns at once. Reports ``on_sent`` per item."""

    @abc.abstractmethod
    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        """Post destination buffers for layers granted to ``peer``; returns at once.
        Reports ``on_received`` per item once its ``dest`` is filled."""

    def post_grant(self, peer: PeerRef, items: Sequence[RecvItem]) -> tuple[str, bytes]:
        """Post ``items`` (:meth:`post_recv`) and return what the Grant granting them carries to
        ``peer``: (``data_address``, ``plane_info``). The receiver's one call into the plane per
        grant; the default posts, then reads :attr:`address` and :meth:`local_info`."""
        self.post_recv(peer, items)
        return self.address, self.local_info(peer)

    @abc.abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """Forget queued sends and posted receives of the transfer (best effort, see module doc)."""

    def unsettled(self) -> dict[str, int]:
        """Cancelled transfers whose peer may still write into their destinations, with the bytes
        each covers: the caller must not reuse that memory yet (the shared-memory plane's
        quarantined grants, decision 114). Default: none (a plane whose cancel waits for every
        write it started). Any thread; cheap when empty."""
        return {}

    @abc.abstractmethod
    def drop_peer(self, peer_instance_id: str) -> None:
        """Close connections/communicators with that peer epoch; never reuse them. Idempotent."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every plane thread and close every socket/communicator. Idempotent, bounded time."""


def posted_for_another(
    table: dict[tuple[str, int], tuple[str, Any]], key: tuple[str, int], peer_id: str
) -> bool:
    """True when the receive posted for ``key`` (transfer id, layer) belongs to another peer epoch: a
    frame from ``peer_id``'s link must neither fill nor drop it (decision 126). Caller holds the lock."""
    entry = table.get(key)
    return entry is not None and entry[0] != peer_id


def fail_queued(items: queue.SimpleQueue[SendItem | None], callbacks: PlaneCallbacks, reason: str) -> None:
    """An outbound link ended: fail (once each) the transfers whose layers are still queued on it."""
    failed: set[str] = set()
    while True:
        try:
            item = items.get_nowait()
        except queue.Empty:
            return
        if item is not None and item.transfer_id not in failed:
            failed.add(item.transfer_id)
            callbacks.on_transfer_failed(item.transfer_id, reason)


# =================================================================================================
# Negotiation
# =================================================================================================

# Per-peer plane negotiation: what each agent says about itself, and the pair's choice.
#
# Every control message that carries ``plane_info`` (Offer, Grant, Pull) starts with this agent's
# :class:`Hello`: host identity (boot id + hostname + network namespace inode: two processes share
# memory and abstract Unix sockets only when all three match), device kind and GPU UUID, the planes it
# holds (with their addresses) and the transport it was forced to, if any. Both ends run
# :func:`choose` on the same two hellos, so they agree without another round trip: the receiver knows
# the sender's hello from the Offer before it posts a receive, and the sender learns the receiver's
# from the first Grant before it sends a byte. Pure functions, unit-tested on their own.

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
# A peer's hello is kept (one per peer epoch, up to MAX_PEERS) and logged: each of its names is short
# (ids, a hostname, a UUID, a plane address), its lists name a host's GPUs and planes.
MAX_HELLO_TEXT = 512
MAX_HELLO_ITEMS = 64


def decode_envelope(info: bytes) -> Envelope:
    """A peer's ``plane_info`` -> :class:`Envelope`; ``ProtocolError`` for anything else (bytes that
    do not decode, nest too deep, force a transport this version does not know, or a hello with a
    name over ``MAX_HELLO_TEXT`` characters or a list over ``MAX_HELLO_ITEMS`` items)."""
    try:
        envelope = _envelope_decoder.decode(info)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"plane handshake does not decode: {exc}") from exc
    hello = envelope.hello
    if hello.forced and hello.forced not in _TRANSPORTS:
        raise ProtocolError(f"plane handshake forces an unknown transport {hello.forced[:32]!r}")
    texts = (hello.instance_id, hello.boot_id, hello.hostname, hello.device, hello.gpu_uuid,
             *hello.peer_gpus, *hello.planes, *hello.planes.values())
    items = max(len(hello.peer_gpus), len(hello.planes), len(envelope.inner))
    if items > MAX_HELLO_ITEMS or any(len(text) > MAX_HELLO_TEXT for text in texts):
        raise ProtocolError(f"plane handshake hello too large ({items} items, names of up to "
                            f"{max(map(len, texts))} characters)")
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


# =================================================================================================
# The plane set
# =================================================================================================

# A set of data planes behind the one :class:`DataPlane` interface, routing every call per peer.
#
# Why a set and not a choice in the agent: the agent's send and receive halves talk to "the plane"
# and key everything by peer epoch already; the only new fact, *which* plane a peer epoch uses, is a
# property of that peer, learnt from the handshake bytes the agent already forwards
# (``local_info`` / ``on_peer_info``). Keeping the routing here leaves the sender and receiver code
# unchanged and gives every member plane the exact contract it had alone
# (docs/decisions/075-plane-negotiation.md).
#
# ``plane_info`` of the set is a :class:`Envelope`: this agent's
# hello plus, per member plane, that plane's own handshake bytes (all members' until the peer's
# hello is known, then only the chosen plane's). Each side chooses with the same pure function on
# the same two hellos, so both agree without an extra round trip.
#
# Class flags: a set whose members disagree takes the conservative value (``ordered`` if any member
# is ordered: an unordered plane accepts items in grant order too; ``supports_*`` only if every
# member does: the agent then gathers/scatters itself, which every plane accepts).
#
# A pair that cannot use a forced transport fails each of its transfers (reason ``transport: ...``,
# naming both ends) from the set's own thread: the calls that discover it (``send``/``post_recv``)
# run under the agent lock and must not call back into the agent.

_FLAGS_ANY = ("ordered",)
_FLAGS_ALL = (
    "supports_spans",
    "supports_device_consumers",
    "supports_device_producers",
    "supports_device_signals",
)
_STOP_WAIT_S = 5.0
#: Peer epochs remembered; the oldest is forgotten beyond (it renegotiates from its next message's
#: hello, which every plane_info carries), so peers that come and go never grow the table.
MAX_PEERS = 4096


@dataclasses.dataclass
class _Peer:
    """What the set knows about one peer epoch."""

    hello: Hello
    choice: Choice
    endpoint: str


class PlaneSet(DataPlane):
    """Holds several planes (in preference order) and routes each peer epoch to the negotiated one."""

    def __init__(
        self,
        members: Sequence[tuple[Backend, DataPlane]],
        instance_id: str,
        device: str,
        forced: Transport,
        board: HealthBoard | None = None,
    ) -> None:
        """``board``: the process's health board (the members should share it); a private one if None."""
        if not members:
            raise ValueError("a plane set needs at least one plane")
        self.members: dict[Backend, DataPlane] = dict(members)
        self.instance_id = instance_id
        self.device = device
        self.forced = forced
        planes = list(self.members.values())
        for flag in _FLAGS_ANY:  # instance values shadow the DataPlane class defaults (see module doc)
            setattr(self, flag, any(getattr(p, flag) for p in planes))
        for flag in _FLAGS_ALL:
            setattr(self, flag, all(getattr(p, flag) for p in planes))
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}  # peer instance id -> hello + choice
        self._hello: Hello | None = None
        self._info_cache: dict[str, bytes] = {}  # peer instance id -> our envelope for it (chosen)
        self.board = board if board is not None else HealthBoard()
        self._failures: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._failer: SupervisedThread | None = None
        self._callbacks: PlaneCallbacks | None = None
        self._address = ""  # made once the members listen (start)

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self, callbacks: PlaneCallbacks) -> None:
        self._callbacks = callbacks
        started: list[DataPlane] = []
        try:
            for plane in self.members.values():
                plane.start(callbacks)
                started.append(plane)
        except BaseException:
            for plane in started:
                plane.close()
            raise
        boot_id, hostname, netns = host_identity()
        cuda = self.device.startswith("cuda")
        self._hello = Hello(
            instance_id=self.instance_id,
            boot_id=boot_id,
            hostname=hostname,
            netns=netns,
            device="cuda" if cuda else "cpu",
            gpu_uuid=_gpu_uuid(self.device) if cuda else "",
            peer_gpus=_peer_gpus(self.device) if cuda else [],
            planes={b.value: p.address for b, p in self.members.items()},
            forced="" if self.forced is Transport.AUTO else self.forced.value,
        )
        self._address = ",".join(f"{b.value}={p.address}" for b, p in self.members.items())
        self._failer = SupervisedThread(
            "kvwire-planes-fail", self._fail_loop, self._stopping, board=self.board
        ).start()

    def close(self) -> None:
        if self._failer is not None:
            self._stopping.set()
            self._failures.put(None)
            self._failer.stop(_STOP_WAIT_S)
        for plane in self.members.values():
            plane.close()

    def allocate(self, num_bytes: int) -> torch.Tensor:
        return next(iter(self.members.values())).allocate(num_bytes)

    def register_memory(self, tensors: Sequence[torch.Tensor]) -> None:
        for plane in self.members.values():
            plane.register_memory(tensors)

    # --- negotiation -------------------------------------------------------------------------------

    def peer_transports(self) -> dict[str, str]:
        """Peer control endpoint -> chosen plane (``"none"`` when the pair has none), for
        heartbeats and logs. Latest epoch per endpoint."""
        with self._lock:
            return {
                p.endpoint: (p.choice.backend.value if p.choice.backend else "none")
                for p in self._peers.values()
            }

    def choice_for(self, peer_instance_id: str) -> Choice | None:
        with self._lock:
            peer = self._peers.get(peer_instance_id)
        return None if peer is None else peer.choice

    def local_info(self, peer: PeerRef) -> bytes:
        assert self._hello is not None, "start() first"
        known, cached = self._known(peer)
        if known is not None and known.choice.backend is not None:
            member = self.members[known.choice.backend]
            return self._envelope(peer, known, member.local_info(self._member_peer(peer, known)), cached)
        inner_all: dict[str, bytes] = {}
        if known is None:  # first contact: every member may be the one; each says its piece
            for backend, member in self.members.items():
                piece = member.local_info(PeerRef(peer.endpoint, peer.instance_id, "", b""))
                if piece:
                    inner_all[backend.value] = piece
        return msgspec.msgpack.encode(Envelope(self._hello, inner_all))

    def _known(self, peer: PeerRef) -> tuple[_Peer | None, bytes | None]:
        """What the set knows of ``peer``, and the plane_info it last sent it (if cached)."""
        with self._lock:
            known = self._peers.get(peer.instance_id) if peer.instance_id else None
            cached = self._info_cache.get(peer.instance_id) if known is not None else None
        return known, cached

    def _envelope(self, peer: PeerRef, known: _Peer, inner: bytes, cached: bytes | None) -> bytes:
        """The set's plane_info for a negotiated ``peer`` around its plane's own ``inner`` bytes."""
        assert self._hello is not None and known.choice.backend is not None
        if not inner and cached is not None:
            return cached  # the common case (TCP, SHM): the same bytes every message
        inner_by_backend = {known.choice.backend.value: inner} if inner else {}
        info = msgspec.msgpack.encode(Envelope(self._hello, inner_by_backend))
        if not inner:
            with self._lock:
                self._info_cache[peer.instance_id] = info
        return info

    def on_peer_info(self, peer: PeerRef, info: bytes) -> None:
        assert self._hello is not None and self._callbacks is not None, "start() first"
        try:
            envelope = decode_envelope(info)
        except ProtocolError as exc:
            self._callbacks.on_protocol_error(f"plane handshake from {peer.endpoint}: {exc}")
            return
        known = self._negotiate(peer, envelope.hello)
        backend = known.choice.backend
        if backend is not None and backend.value in envelope.inner:
            self.members[backend].on_peer_info(self._member_peer(peer, known), envelope.inner[backend.value])

    def _negotiate(self, peer: PeerRef, hello: Hello) -> _Peer:
        assert self._hello is not None
        with self._lock:
            known = self._peers.get(peer.instance_id)
            if known is not None:
                return known
            choice = choose(self._hello, hello)
            known = self._peers[peer.instance_id] = _Peer(hello, choice, peer.endpoint)
            while len(self._peers) > MAX_PEERS:
                oldest = next(iter(self._peers))  # dicts keep insertion order
                del self._peers[oldest]
                self._info_cache.pop(oldest, None)
        if choice.backend is not None:
            log.info(
                "data plane with peer %s (%s): %s", peer.endpoint, hello.describe(), choice.backend.value
            )
        else:
            log.error("no data plane with peer %s: %s", peer.endpoint, choice.error)
        return known

    def for_peer(self, peer: PeerRef) -> DataPlane:
        """The member negotiated with ``peer`` (this set, with its conservative flags, until then)."""
        with self._lock:
            known = self._peers.get(peer.instance_id)
        if known is not None and known.choice.backend is not None:
            return self.members[known.choice.backend]
        return self

    def _route(self, peer: PeerRef, transfer_ids: Sequence[str]) -> tuple[DataPlane, PeerRef] | None:
        """The member plane for ``peer`` (negotiated), or None after scheduling the transfers' failure."""
        with self._lock:
            known = self._peers.get(peer.instance_id)
        if known is not None and known.choice.backend is not None:
            return self.members[known.choice.backend], self._member_peer(peer, known)
        self._fail_unrouted(peer, known, transfer_ids)
        return None

    def _fail_unrouted(self, peer: PeerRef, known: _Peer | None, transfer_ids: Sequence[str]) -> None:
        """Schedule the failure of transfers with a peer that has no plane (yet, or at all)."""
        if known is None:
            error = f"no plane handshake from peer {peer.endpoint} (instance {peer.instance_id[:8]})"
        else:
            error = known.choice.error
        for tid in dict.fromkeys(transfer_ids):
            self._failures.put((tid, f"{FailReason.TRANSPORT.value}: {error}"))

    @staticmethod
    def _member_peer(peer: PeerRef, known: _Peer) -> PeerRef:
        assert known.choice.backend is not None
        address = known.hello.planes.get(known.choice.backend.value, "")
        return PeerRef(peer.endpoint, peer.instance_id, address, peer.plane_info)

    # --- data --------------------------------------------------------------------------------------

    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        routed = self._route(peer, [i.transfer_id for i in items])
        if routed is not None:
            routed[0].send(routed[1], items)

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        routed = self._route(peer, [i.transfer_id for i in items])
        if routed is not None:
            routed[0].post_recv(routed[1], items)

    def post_grant(self, peer: PeerRef, items: Sequence[RecvItem]) -> tuple[str, bytes]:
        """:meth:`post_recv` then (:attr:`address`, :meth:`local_info`), with one call into the
        member negotiated with ``peer`` (its own address is in the hello: not needed here)."""
        known, cached = self._known(peer)
        if known is None or known.choice.backend is None:
            self._fail_unrouted(peer, known, [i.transfer_id for i in items])
            return self.address, self.local_info(peer)
        member = self.members[known.choice.backend]
        _, inner = member.post_grant(self._member_peer(peer, known), items)
        return self._address, self._envelope(peer, known, inner, cached)

    def cancel(self, transfer_id: str) -> None:
        for plane in self.members.values():
            plane.cancel(transfer_id)

    def unsettled(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for plane in self.members.values():
            out.update(plane.unsettled())
        return out

    def drop_peer(self, peer_instance_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_instance_id, None)
            self._info_cache.pop(peer_instance_id, None)
        for plane in self.members.values():
            plane.drop_peer(peer_instance_id)

    def _fail_loop(self) -> None:
        """The fail loop's body (supervised): fail scheduled transfers until close's end marker."""
        assert self._callbacks is not None
        while (failure := self._failures.get()) is not None:
            try:
                self._callbacks.on_transfer_failed(*failure)
            except Exception:  # one failing callback must not stop the others' failures
                log.exception("failing transfer %s (%s) raised", *failure)
                self.board.worker_error("kvwire-planes-fail")


def _peer_gpus(device: str) -> list[str]:
    """UUIDs of the other CUDA devices of this host that ``device`` can access peer to peer."""
    try:
        index = torch.device(device).index or 0
        return [
            _gpu_uuid(f"cuda:{other}")
            for other in range(torch.cuda.device_count())
            if other != index and torch.cuda.can_device_access_peer(index, other)
        ]
    except (RuntimeError, AssertionError, AttributeError):
        return []


def _gpu_uuid(device: str) -> str:
    """The CUDA device's UUID ("" when it cannot be read, e.g. no driver)."""
    try:
        return str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    except (RuntimeError, AssertionError, AttributeError):
        return ""


# =================================================================================================
# Planes that accept links
# =================================================================================================

# The one listener lifecycle every socket plane shares (TCP, shared memory, CUDA IPC): a bounded,
# supervised acceptor, one reader thread per inbound link, one writer per outbound peer, the close
# that stops them all, and the bookkeeping of cancelled transfers.
#
# A plane supplies its listening socket (:meth:`ListenerPlane._open_listener`), how a connection's peer
# is named for the per-peer cap (:meth:`ListenerPlane._peer`), the reader of an accepted connection
# (:meth:`ListenerPlane._inbound_link`) and what it cleans up on close (:meth:`_closing_locked`,
# :meth:`_closed`). The listener is bounded by :mod:`~kvwire.transfer.planes.common.admission`
# (connections per listener and per peer, the handshake deadline, back-off on EMFILE;
# docs/decisions/115-data-link-bounds.md) and its acceptor is a
# :class:`~kvwire.supervision.SupervisedThread` (restarted with backoff, or marked dead on the board).
#
# Threads: ``start``/``close``/``cancel`` run on the caller's thread; the acceptor and every reader
# and writer on their own. ``lock`` guards ``outbound``, ``inbound``, ``readers`` and ``cancelled``.

JOIN_S = 5.0  # a plane thread not gone by then is left (daemon) and logged by its owner
MAX_CANCELLED = 4096  # cancelled ids kept before the old ones (past CANCEL_MEMORY_S) are dropped


class WriterLink(Protocol):
    """A plane's writer for one peer epoch (:class:`~kvwire.transfer.planes.common.outbound.OutboundLink`)."""

    thread: threading.Thread

    def stop(self) -> None: ...


class ReaderLink(Protocol):
    """A plane's reader of one accepted connection."""

    def serve(self) -> None: ...


OutT = TypeVar("OutT", bound=WriterLink)


class ListenerPlane(DataPlane, Generic[OutT]):
    """Base of the planes that accept links on a listening socket; ``OutT`` is the plane's writer."""

    #: the plane's name in its admission, socket address and thread names ("tcp", "shm", "ipc")
    link_kind: ClassVar[str]
    #: the agent's callbacks, set by :meth:`start` (a plain field: the plane's threads read it for
    #: every layer they report)
    callbacks: PlaneCallbacks

    def __init__(self, config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> None:
        self.config = config
        self.instance_id = instance_id
        self.secret = config.secret
        self.board = board if board is not None else HealthBoard()
        self.admission = Admission(self.link_kind, config.links, self.board)
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.outbound: dict[str, OutT] = {}  # peer instance id -> the plane's outbound link
        self.inbound: dict[socket.socket, str] = {}  # connection -> peer instance id ("" = handshaking)
        self.readers: set[threading.Thread] = set()
        self.cancelled: dict[str, float] = {}  # transfer id -> when cancelled (time.monotonic())
        self._listener: socket.socket | None = None
        self._address = ""
        self._acceptor: SupervisedThread | None = None

    # --- what a plane supplies -------------------------------------------------------------------

    def _open_listener(self) -> tuple[socket.socket, str]:
        """A bound, listening socket and the address peers dial (called once, by :meth:`start`)."""
        raise NotImplementedError

    def _peer(self, conn: socket.socket, addr: object) -> str:
        """Who ``conn`` is for the per-peer cap (TCP: the remote IP; Unix sockets: the process)."""
        raise NotImplementedError

    def _inbound_link(self, conn: socket.socket) -> ReaderLink:
        """The plane's reader of one accepted connection (its ``serve`` runs on a thread of its own)."""
        raise NotImplementedError

    def _closing_locked(self) -> None:
        """Called once, under ``lock``, when close starts (drop what no thread may pick up any more)."""

    def _closed(self) -> None:
        """Called once after every plane thread was joined, before the listener closes."""

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self, callbacks: PlaneCallbacks) -> None:
        self.callbacks = callbacks
        listener, address = self._open_listener()
        listener.settimeout(POLL_S)
        self._listener, self._address = listener, address
        self._acceptor = SupervisedThread(
            f"kvwire-{self.link_kind}-accept",
            lambda: accept_loop(listener, self.admission, self.closing, self._peer, self._serve),
            self.closing,
            board=self.board,
        ).start()

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        with self.lock:
            outbound: list[OutT] = list(self.outbound.values())
            inbound = list(self.inbound)
            self._closing_locked()
        for out in outbound:
            out.stop()
        for conn in inbound:
            shutdown(conn)
        if self._acceptor is not None:
            self._acceptor.stop(JOIN_S)
        for out in outbound:
            out.thread.join(timeout=JOIN_S)
        with self.lock:
            readers = list(self.readers)
        for reader in readers:
            reader.join(timeout=JOIN_S)
        self._closed()
        if self._listener is not None:
            self._listener.close()

    # --- cancelled transfers ---------------------------------------------------------------------

    def is_cancelled(self, transfer_id: str) -> bool:
        with self.lock:
            return transfer_id in self.cancelled

    def _note_cancelled(self, transfer_id: str) -> None:
        """Remember a cancelled transfer (bounded). Caller holds ``lock``."""
        now = time.monotonic()
        self.cancelled[transfer_id] = now
        if len(self.cancelled) > MAX_CANCELLED:
            self.cancelled = {t: s for t, s in self.cancelled.items() if now - s < CANCEL_MEMORY_S}

    def _serve(self, conn: socket.socket) -> None:
        """Start the reader of a connection the admission took on (acceptor thread)."""
        link = self._inbound_link(conn)
        start_reader(self, conn, f"kvwire-{self.link_kind}-recv", link.serve)


# =================================================================================================
# Planes on abstract Unix sockets (same host)
# =================================================================================================

# What the same-host planes (``shm``, ``ipc``) share on top of the listener lifecycle
# (:class:`ListenerPlane`): a Linux abstract Unix socket that
# peers connect to, a peer named by its process for the per-peer cap, and the table of destinations a
# peer granted. Each plane supplies its link classes (:meth:`UnixLinkPlane._inbound_link`) and what it
# cleans up on close.
#
# The listener is bounded like the TCP plane's (:mod:`~kvwire.transfer.planes.common.admission`:
# connections per listener and per peer process, the handshake deadline, back-off on EMFILE) and its
# acceptor is supervised. After the hello every link's socket keeps a timeout,
# ``links.link_timeout_s``: a write to a peer that stops reading fails after that long without
# progress. Readers treat a read timeout as an idle moment (a dead peer shows as EOF: its descriptors
# close with its process).

_Dest = TypeVar("_Dest")

GRANTED_FULL = "data_granted_dests_full"  # kvwire_limit_hits_total{limit}: a destination not kept


class GrantedDests(Generic[_Dest]):
    """Destinations peers granted this sender (one-copy writes), by (transfer id, layer), each owned by
    the peer epoch that granted it. The caller holds the plane's lock.

    A peer names them in its ``plane_info``, for any transfer id it likes, and an entry leaves only
    when its layer is sent, its transfer is cancelled here or its peer is dropped: so the table is
    capped, per peer epoch and in all (``DataLinkConfig.max_granted_dests_per_peer``,
    ``max_granted_dests``), and one peer cannot grow it nor take another's share below the total. A
    destination over a cap is not kept (counted on the board; :meth:`put` says how many): the sender
    then writes that layer its other way (the shared-memory ring) or fails it (CUDA IPC: no
    destination granted)."""

    def __init__(self, board: HealthBoard, links: DataLinkConfig) -> None:
        self._board = board
        self._per_peer = links.max_granted_dests_per_peer
        self._total = links.max_granted_dests
        self._items: dict[tuple[str, int], tuple[str, _Dest]] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        board.limit_hit(GRANTED_FULL, 0)  # exported at 0 before the first hit

    def put(self, peer_id: str, granted: Sequence[tuple[tuple[str, int], _Dest]]) -> int:
        """Keep what ``peer_id`` granted (an entry replaces the one of its key); how many a cap refused."""
        refused = 0
        for key, dest in granted:
            self._pop(key)
            if self._counts[peer_id] >= self._per_peer or len(self._items) >= self._total:
                refused += 1
                continue
            self._items[key] = (peer_id, dest)
            self._counts[peer_id] += 1
        if refused:
            self._board.limit_hit(GRANTED_FULL, refused)
        return refused

    def take(self, peer_id: str, key: tuple[str, int]) -> _Dest | None:
        """Remove and return the destination ``peer_id`` granted for ``key`` (transfer id, layer): None
        when there is none or another peer granted it (the sender then uses its fallback or fails the
        layer)."""
        entry = self._items.get(key)
        if entry is None or entry[0] != peer_id:
            return None
        self._pop(key)
        return entry[1]

    def drop_transfer(self, transfer_id: str) -> None:
        for key in [k for k in self._items if k[0] == transfer_id]:
            self._pop(key)

    def drop_peer(self, peer_id: str) -> None:
        for key in [k for k, (pid, _) in self._items.items() if pid == peer_id]:
            self._pop(key)

    def clear(self) -> None:
        self._items.clear()
        self._counts.clear()

    def _pop(self, key: tuple[str, int]) -> None:
        entry = self._items.pop(key, None)
        if entry is not None:
            self._counts[entry[0]] -= 1
            if self._counts[entry[0]] <= 0:
                del self._counts[entry[0]]

    def __len__(self) -> int:
        return len(self._items)


def take_granted(
    lock: threading.Lock, table: GrantedDests[_Dest], peer_id: str, key: tuple[str, int]
) -> _Dest | None:
    """:meth:`GrantedDests.take` under the plane's ``lock`` (a sender's writer thread)."""
    with lock:
        return table.take(peer_id, key)


class UnixLinkPlane(ListenerPlane[OutT]):
    """Base of the planes whose links are abstract Unix sockets (one network namespace, one host)."""

    def _open_listener(self) -> tuple[socket.socket, str]:
        address = f"@kvwire-{self.link_kind}-{self.instance_id}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(abstract_name(address))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        return listener, address

    def _peer(self, conn: socket.socket, addr: object) -> str:
        return unix_peer(conn, addr)
