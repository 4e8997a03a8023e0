"""A set of data planes behind the one :class:`DataPlane` interface, routing every call per peer.

Why a set and not a choice in the agent: the agent's send and receive halves talk to "the plane"
and key everything by peer epoch already; the only new fact, *which* plane a peer epoch uses, is a
property of that peer, learnt from the handshake bytes the agent already forwards
(``local_info`` / ``on_peer_info``). Keeping the routing here leaves the sender and receiver code
unchanged and gives every member plane the exact contract it had alone
(docs/decisions/075-plane-negotiation.md).

``plane_info`` of the set is a :class:`~kvwire.transfer.planes.negotiation.Envelope`: this agent's
hello plus, per member plane, that plane's own handshake bytes (all members' until the peer's
hello is known, then only the chosen plane's). Each side chooses with the same pure function on
the same two hellos, so both agree without an extra round trip.

Class flags: a set whose members disagree takes the conservative value (``ordered`` if any member
is ordered: an unordered plane accepts items in grant order too; ``supports_*`` only if every
member does: the agent then gathers/scatters itself, which every plane accepts).

A pair that cannot use a forced transport fails each of its transfers (reason ``transport: ...``,
naming both ends) from the set's own thread: the calls that discover it (``send``/``post_recv``)
run under the agent lock and must not call back into the agent.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Sequence

import msgspec
import torch

from kvwire.errors import ProtocolError
from kvwire.supervision import HealthBoard, SupervisedThread
from kvwire.transfer.enums import Backend, FailReason, Transport
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks
from kvwire.transfer.planes.negotiation import Choice, Envelope, Hello, choose, decode_envelope, host_identity

log = logging.getLogger("kvwire.transfer")
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
        self._failer = SupervisedThread(
            "kvwire-planes-fail", self._fail_loop, self._stopping, board=self.board
        ).start()

    @property
    def address(self) -> str:
        return ",".join(f"{b.value}={p.address}" for b, p in self.members.items())

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
        with self._lock:
            known = self._peers.get(peer.instance_id) if peer.instance_id else None
            cached = self._info_cache.get(peer.instance_id) if known is not None else None
        if known is not None and known.choice.backend is not None:
            member = self.members[known.choice.backend]
            inner = member.local_info(self._member_peer(peer, known))
            if not inner and cached is not None:
                return cached  # the common case (TCP, SHM): the same bytes every message
            info = msgspec.msgpack.encode(
                Envelope(self._hello, {known.choice.backend.value: inner} if inner else {})
            )
            if not inner:
                with self._lock:
                    self._info_cache[peer.instance_id] = info
            return info
        inner_all: dict[str, bytes] = {}
        if known is None:  # first contact: every member may be the one; each says its piece
            for backend, member in self.members.items():
                piece = member.local_info(PeerRef(peer.endpoint, peer.instance_id, "", b""))
                if piece:
                    inner_all[backend.value] = piece
        return msgspec.msgpack.encode(Envelope(self._hello, inner_all))

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
        if known is None:
            error = f"no plane handshake from peer {peer.endpoint} (instance {peer.instance_id[:8]})"
        else:
            error = known.choice.error
        for tid in dict.fromkeys(transfer_ids):
            self._failures.put((tid, f"{FailReason.TRANSPORT.value}: {error}"))
        return None

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
