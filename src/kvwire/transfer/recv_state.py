"""One transfer on the receive side: what was expected, offered, granted, landed and delivered."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

import torch

from kvwire.transfer.buffers import RecvBuffer
from kvwire.transfer.control_messages import Grant
from kvwire.transfer.core import TransferState
from kvwire.transfer.registered_caches import BlockTarget, PagedKV
from kvwire.transfer.types import ByteSpans, DeviceConsumer, LayerSink, LayerSpec, PeerRef

SpansFn = Callable[[int], ByteSpans]  # layer index -> where its bytes go


class WriteGuard:
    """Makes "once the transfer failed, nothing writes into the caller's blocks" hold for the copy
    path: a write runs under the guard's lock and only while it is open; :meth:`close` (on failure,
    under the agent lock) waits for a running write and stops later ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    def wrap(self, write: LayerSink) -> LayerSink:
        def guarded(index: int, data: torch.Tensor) -> None:
            with self._lock:
                if self._open:
                    write(index, data)

        return guarded

    def close(self) -> None:
        with self._lock:
            self._open = False


@dataclasses.dataclass
class RecvState(TransferState):
    created_s: float = 0.0  # on the core's clock: when this side first heard of the transfer
    expected: bool = False  # expect() was called
    num_layers: int | None = None
    sink: LayerSink | None = None
    pull_from: str | None = None
    # The one sender endpoint this transfer may come from (the P/D pair the router named); offers
    # from any other agent are refused. None: the first offer wins.
    accept_from: str | None = None
    sender: str | None = None  # push: the sender's control endpoint, known before its Offer
    sender_id: str | None = None  # the sender's epoch as seen in its Renews before the Offer
    scatter_into: SpansFn | None = None  # destination spans per layer (zero-copy receive)
    # expect(into_blocks=...): the registered caches' blocks this transfer lands in (see registered_caches)
    paged: PagedKV | None = None
    target: BlockTarget | None = None
    consumer: DeviceConsumer | None = None  # built once, for a device-consumer plane
    consumed: set[int] = dataclasses.field(default_factory=set)  # granted with the device consumer
    guard: WriteGuard | None = None  # the copy path's writes into the caller's blocks
    first_arrival: float | None = None  # time.monotonic() of the first layer landing
    specs: list[LayerSpec] | None = None  # from the Offer
    with_trailer: bool = False
    peer: PeerRef | None = None  # the sender (epoch + data address), from the Offer
    to_grant: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    # posted, not arrived (None: straight into the caller's scatter_into spans)
    granted: dict[int, RecvBuffer | None] = dataclasses.field(default_factory=dict)
    held: dict[int, RecvBuffer] = dataclasses.field(default_factory=dict)  # arrived, buffered
    delivering: set[int] = dataclasses.field(default_factory=set)  # in a sink call now
    arrived: set[int] = dataclasses.field(default_factory=set)  # delivered to the sink or held
    trailer: bytes | None = None
    # Layers granted before the sender's Offer (decision 110): index -> bytes granted; and that
    # grant, sent again (as an ordinary one) when the Offer comes, in case the sender did not keep it
    early: dict[int, int] = dataclasses.field(default_factory=dict)
    early_grant: Grant | None = None
    # created by this sender's Offer before expect(): counted against ControlLimits.max_pending_per_peer
    unsolicited_by: str | None = None

    @property
    def bound_peer(self) -> PeerRef | None:
        return self.peer

    def peer_endpoint(self) -> str | None:
        """The sender's endpoint: from its Offer, else the pulled one, else the one named in push."""
        if self.peer is not None:
            return self.peer.endpoint
        return self.pull_from if self.pull_from is not None else self.sender

    def abort_endpoint(self) -> str | None:
        """Told of a failure: the Offer's sender or the pulled one (not a push sender only named)."""
        return self.peer.endpoint if self.peer is not None else self.pull_from

    def complete(self) -> bool:
        return (
            self.expected
            and self.specs is not None
            and len(self.arrived) == len(self.specs)
            and not self.delivering
            and (self.sink is None or not self.held)
            and (not self.with_trailer or self.trailer is not None)
        )

    def all_landed(self) -> bool:
        """Every layer landed (delivered, held or in a sink call now)."""
        return self.specs is not None and len(self.arrived | self.delivering) >= len(self.specs)

    def early_only(self, peer_id: str) -> bool:
        """Granted early to ``peer_id`` (decision 110) from what this side knew of the sender, with
        no sign that that epoch ever had the transfer: no Offer, no layer, no Renew reporting it."""
        landed = self.arrived or self.delivering or self.held
        return bool(self.early) and self.specs is None and not landed and self.sender_id != peer_id
