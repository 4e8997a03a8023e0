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

Implementations: one subpackage per plane under :mod:`kvwire.transfer.planes` (``tcp``, ``nccl``),
built by :func:`kvwire.transfer.planes.factory.make_plane`, which imports them lazily (this module
imports none of them: no import circle).
"""

from __future__ import annotations

import abc
import queue
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch

from kvwire.transfer.memory import PeerRef, RecvItem, SendItem


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
    #: (:data:`kvwire.transfer.types.DeviceConsumer`): no host wake-up between data and consumer.
    supports_device_consumers: ClassVar[bool] = False
    #: True when the plane runs ``SendItem.on_device`` producers on its send stream right before each
    #: message (:data:`kvwire.transfer.types.DeviceProducer`).
    supports_device_producers: ClassVar[bool] = False
    #: True when the plane honours ``SendItem.ready_signal`` (a device-side wait before the sends).
    supports_device_signals: ClassVar[bool] = False

    @abc.abstractmethod
    def start(self, callbacks: PlaneCallbacks) -> None:
        """Bind/listen and start the plane's threads. Called once, before any other method."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """What peers need to reach this plane (TCP: "host:port"); sent in OFFER/GRANT messages."""

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
