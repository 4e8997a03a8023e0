"""Receive side of the agent: one transfer's state, credit, arrivals, and the side itself.

Read in order: a receive's state (:class:`RecvState`); credit (grants from the memory budget,
early grants); what happens once a layer lands (sinks, acks, completion); the :class:`Receiver`
(expectations, offers, renewals, failures).

A receive's state
-----------------
One transfer on the receive side: what was expected, offered, granted, landed and delivered.

Credit
------
A receiver grants a layer (a :class:`~kvwire.transfer.core.Grant`) once it posted where the layer
lands: the caller's spans or blocks (in place), or a buffer reserved from the receive budget or the
spill pool. :class:`Credit` keeps the FIFO of transfers waiting for credit and runs the grant pass
(no transfer overtakes one that waits for memory). It also grants every layer *early*, before the
sender's Offer, where that is safe (decision 110), and checks the Offer against that grant.

Arrivals
--------
Receive side, after the grant: layers landing, sink deliveries, acks, completion, finished layers.

Every method runs with ``core.lock`` held; a sink is called by the agent without it (``on_received``
and ``take_held_for_sink`` hand the call out, ``delivered`` takes its return).

The receive side
----------------
Receive side of the agent: expectations, offers, renewals and failures of the transfers it receives.

Credit (grants from the memory budget, early grants) is :class:`Credit`; what happens once a layer
lands (sinks, acks, completion) is :class:`Arrivals`; leases, expiry and the one ``fail`` are
:class:`kvwire.transfer.core.Transfers`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import msgspec
import torch

from kvwire.errors import TransferError
from kvwire.transfer.buffers import BufferKind, RecvBuffer
from kvwire.transfer.core import (
    Abort,
    Ack,
    ControlLimit,
    Core,
    Grant,
    Lease,
    Offer,
    PeerState,
    Pull,
    Renew,
    Trailer,
    Transfers,
    TransferState,
)
from kvwire.transfer.enums import FailReason
from kvwire.transfer.memory import (
    DTYPES_BY_NAME,
    BlockTarget,
    ByteSpans,
    DeviceConsumer,
    LayerSink,
    LayerSpec,
    PagedKV,
    PeerRef,
    PullSlice,
    RecvItem,
    TransferTiming,
)

# ============================== A receive's state

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


# ============================== Credit

_NO_DEST = torch.empty(0, dtype=torch.uint8)


class Credit:
    """The receiver's grants (see the module docstring)."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.core: Core = receiver.core
        self.queue: collections.deque[str] = collections.deque()  # FIFO of transfers wanting credit

    def offered(self, st: RecvState) -> None:
        """The Offer of ``st`` was taken: queue its layers not granted early, and grant what fits."""
        assert st.specs is not None
        if st.early:
            self._check_early(st)
        st.to_grant.extend(i for i in range(len(st.specs)) if i not in st.early)
        self.queue.append(st.transfer_id)
        self.grant_pass()

    def grant_pass(self) -> None:
        """Reserve memory for waiting layers in FIFO order; post buffers, then send Grants."""
        recvs = self.receiver.table
        while self.queue:
            st = recvs.get(self.queue[0])
            if st is None or not st.to_grant or st.specs is None or st.peer is None:
                self.queue.popleft()
                continue
            items = self._grantable(st, st.specs)
            if items and st.transfer_id in recvs:
                self._grant(st, items)
            if st.transfer_id in recvs and st.to_grant:
                return  # out of memory: later transfers wait too (FIFO, no starvation)

    def _grantable(self, st: RecvState, specs: list[LayerSpec]) -> list[RecvItem]:
        """Take layers off ``st.to_grant`` while each has somewhere to land; stop at the first that
        has not (out of memory) or when the transfer failed."""
        memory = self.core.memory
        items: list[RecvItem] = []
        while st.to_grant:
            index = st.to_grant[0]
            num_bytes = specs[index].num_bytes
            in_place = self._in_place(st, index, num_bytes)
            if in_place == "spans" or (
                st.expected and st.scatter_into is not None and self.core.plane.supports_spans
            ):
                item = self._span_item(st, index, num_bytes)
                if item is None:
                    break
                st.to_grant.popleft()
                st.granted[index] = None
                items.append(item)
                continue
            if num_bytes > memory.largest_buffer_bytes:  # else it would wait at the head for ever
                reason = f"{FailReason.BUDGET.value}: layer of {num_bytes} bytes never fits"
                self.receiver.fail(st.transfer_id, reason, True)
                break
            buf = memory.reserve(num_bytes)
            if buf is None:
                self.core.stats.add("credit_waits")
                break
            if buf.kind is BufferKind.SPILL:
                self.core.stats.add("spilled_layers")
            st.to_grant.popleft()
            st.granted[index] = buf
            consumer = None
            if in_place == "device" and buf.kind is not BufferKind.SPILL:
                consumer = self._consumer(st)
                st.consumed.add(index)
            dest = buf.tensor[:num_bytes]
            items.append(RecvItem(st.transfer_id, index, num_bytes, dest, on_device=consumer))
        return items

    def _in_place(self, st: RecvState, index: int, num_bytes: int) -> str | None:
        """How layer ``index`` of an ``into_blocks`` transfer lands without a host copy: "spans"
        (the plane writes into the blocks), "device" (the plane's stream scatters behind the receive),
        or None (buffered, then the sink copies)."""
        paged, target = st.paged, st.target
        if not st.expected or paged is None or target is None or st.peer is None:
            return None
        plane = self.core.plane.for_peer(st.peer)  # the plane negotiated with the sender
        if not paged.takes_exactly(target, index, num_bytes):
            return None
        if plane.supports_spans and paged.contiguous:
            return "spans"
        if plane.supports_device_consumers and paged.device_paths():
            return "device"
        return None

    def _consumer(self, st: RecvState) -> DeviceConsumer:
        if st.consumer is None:
            assert st.paged is not None and st.target is not None
            st.consumer = st.paged.consumer(st.target)
        return st.consumer

    def _spans(self, st: RecvState, index: int) -> ByteSpans | None:
        """Where layer ``index`` lands (``scatter_into`` or the target blocks); None: the transfer failed."""
        try:
            if st.scatter_into is not None:
                return st.scatter_into(index)
            assert st.paged is not None and st.target is not None
            return st.paged.spans(index, st.target.block_ids)
        except Exception as exc:
            reason = f"{FailReason.MISMATCH.value}: scatter_into({index}): {exc!r}"
            self.receiver.fail(st.transfer_id, reason, True)
            return None

    def _span_item(self, st: RecvState, index: int, num_bytes: int) -> RecvItem | None:
        spans = self._spans(st, index)
        if spans is None:
            return None
        if spans.num_bytes != num_bytes:
            reason = (
                f"{FailReason.MISMATCH.value}: layer {index} spans hold {spans.num_bytes}, sender {num_bytes}"
            )
            self.receiver.fail(st.transfer_id, reason, True)
            return None
        return RecvItem(st.transfer_id, index, num_bytes, _NO_DEST, dest_spans=spans)

    def _grant(self, st: RecvState, items: list[RecvItem], early: bool = False) -> Grant:
        assert st.peer is not None
        # posted before the Grant leaves: a fast sender finds its buffers
        data_address, plane_info = self.core.plane.post_grant(st.peer, items)
        msg = Grant(
            **self.core.header(st.peer.endpoint, st.transfer_id, st.peer.instance_id),
            layers=[item.layer_index for item in items],
            data_address=data_address,
            plane_info=plane_info,
            early=early,
            sizes=[item.num_bytes for item in items] if early else [],
        )
        self.core.send(st.peer.endpoint, msg)
        return msg

    # --- early grants (decision 110) ---------------------------------------------------------------------

    def grant_early(self, st: RecvState) -> None:
        """Grant every layer now, before the sender's Offer (decision 110), when that is safe: push
        mode with the sender's endpoint given (``expect(sender=...)``) and its epoch known (an
        earlier contact), layers that land in spans (``scatter_into``, or ``into_blocks`` whose
        blocks are whole and contiguous), and a plane negotiated with that sender that takes early
        grants. The sender then starts writing as soon as it has a layer, without the Offer -> Grant
        round trip. The Offer is checked against what was granted when it comes."""
        peer = self._early_peer(st)
        if peer is None or st.num_layers is None:
            return
        plane = self.core.plane.for_peer(peer)
        if not (plane.early_grants and plane.supports_spans):
            return
        items: list[RecvItem] = []
        for index in range(st.num_layers):
            spans = self._spans(st, index)
            if spans is None:
                return  # failed (the target could not say where the layer goes)
            items.append(RecvItem(st.transfer_id, index, spans.num_bytes, _NO_DEST, dest_spans=spans))
        st.peer = peer
        for item in items:
            st.granted[item.layer_index] = None
            st.early[item.layer_index] = item.num_bytes
        st.early_grant = self._grant(st, items, early=True)
        self.core.stats.add("early_grants")

    def _early_peer(self, st: RecvState) -> PeerRef | None:
        """The sender an early grant of ``st`` would go to (None: not safe to grant early)."""
        if not st.expected or st.specs is not None or st.peer is not None or st.sender is None:
            return None
        if st.pull_from is not None or st.num_layers is None:
            return None
        if st.scatter_into is None and (
            st.paged is None or st.target is None or not st.paged.contiguous or st.target.skip_blocks
        ):
            return None
        sender_id = st.sender_id or self.core.peer_ids.get(st.sender)
        return PeerRef(st.sender, sender_id, "") if sender_id else None

    def _check_early(self, st: RecvState) -> None:
        """The Offer of an early-granted transfer. Layers the sizes granted: the grant is sent again
        as an ordinary one (a sender that did not keep it gets it now; one that used it finds
        nothing new in it). Other sizes (P sends more blocks than D takes, say): the sender did not
        use the grant (it checks the sizes), so nothing was written under it; the layers are
        granted afresh, the ordinary way, and the new posts replace the early ones."""
        assert st.specs is not None and st.peer is not None
        fits = all(
            index < len(st.specs) and st.specs[index].num_bytes == num_bytes
            for index, num_bytes in st.early.items()
        )
        if not fits:
            self.forget_early(st)
            return
        grant, st.early_grant = st.early_grant, None
        if grant is not None:
            self.core.send(st.peer.endpoint, msgspec.structs.replace(grant, early=False, sizes=[]))

    def forget_early(self, st: RecvState) -> None:
        """Drop a transfer's early grant (its layers are granted again the ordinary way, on the
        Offer); counted in ``early_grants_unused``."""
        for index in st.early:
            st.granted.pop(index, None)
        st.early.clear()
        st.early_grant = None
        self.core.stats.add("early_grants_unused")


# ============================== Arrivals

@dataclasses.dataclass
class _AckBatch:
    endpoint: str
    dst_id: str
    layers: list[int] = dataclasses.field(default_factory=list)
    trailer: bool = False


class Arrivals:
    """What landed for the receiver's transfers, and what finished transfers left to take."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.core: Core = receiver.core
        self.done_layers: dict[str, dict[int, RecvBuffer]] = {}
        self.done_specs: dict[str, list[LayerSpec]] = {}
        self.done_trailers: dict[str, bytes] = {}
        self.acks: dict[str, _AckBatch] = {}

    # --- landing -----------------------------------------------------------------------------------------

    def on_received(
        self, peer_id: str, transfer_id: str, index: int
    ) -> tuple[LayerSink, torch.Tensor] | None:
        """A layer landed. Returns (sink, tensor) when the caller must call the sink (without the lock)."""
        st = self.receiver.table.get(transfer_id)
        if st is None or st.peer is None or st.peer.instance_id != peer_id or index not in st.granted:
            return None
        buf = st.granted.pop(index)
        # an early-granted layer may land before its Offer is read (decision 110)
        num_bytes = st.specs[index].num_bytes if st.specs is not None else st.early[index]
        self.core.stats.add("bytes_received", num_bytes)
        if st.first_arrival is None:
            st.first_arrival = self.core.now()
        self.ack(st, index)
        if buf is None or index in st.consumed:  # landed in the caller's blocks (spans or consumer)
            if buf is not None:
                buf.release()  # the plane reports a consumed layer only after its scatter finished
            st.arrived.add(index)
            self.maybe_complete(st)
            self.receiver.credit.grant_pass()
            return None
        assert st.specs is not None  # a buffered layer was granted from its Offer
        if st.sink is not None and st.expected:
            st.delivering.add(index)
            st.held[index] = buf
            return st.sink, self.layer_view(buf, st.specs[index], owned=False)
        st.held[index] = buf
        st.arrived.add(index)
        self.maybe_complete(st)
        return None

    def take_held_for_sink(self, transfer_id: str) -> list[tuple[int, LayerSink, torch.Tensor]]:
        st = self.receiver.table.get(transfer_id)
        if st is None or st.sink is None or st.specs is None:
            return []
        out = []
        for index, buf in st.held.items():
            if index not in st.delivering:
                st.delivering.add(index)
                st.arrived.discard(index)
                out.append((index, st.sink, self.layer_view(buf, st.specs[index], owned=False)))
        return out

    def delivered(self, transfer_id: str, index: int) -> None:
        """The sink returned for ``index``: free its buffer, maybe complete, grant more."""
        st = self.receiver.table.get(transfer_id)
        if st is None or index not in st.delivering:
            return
        st.delivering.discard(index)
        st.held.pop(index).release()
        st.arrived.add(index)
        self.maybe_complete(st)
        self.receiver.credit.grant_pass()

    def maybe_complete(self, st: RecvState) -> None:
        recvs = self.receiver.table
        if not st.complete() or st.transfer_id not in recvs:
            return
        assert st.specs is not None
        del recvs[st.transfer_id]
        if st.sink is None:
            self.done_layers[st.transfer_id] = st.held
            self.done_specs[st.transfer_id] = st.specs
        if st.trailer is not None:
            self.done_trailers[st.transfer_id] = st.trailer
        timing = None
        if st.first_arrival is not None:
            num_bytes = sum(spec.num_bytes for spec in st.specs)
            timing = TransferTiming(num_bytes, self.core.now() - st.first_arrival, done_unix_s=time.time())
        self.core.events.recvd(st.transfer_id, timing)
        self.core.stats.add("recvs_completed")
        self.core.tombstones.add(self.receiver.side, st.transfer_id, "done")

    # --- acks --------------------------------------------------------------------------------------------

    def ack(self, st: RecvState, index: int | None, trailer: bool = False) -> None:
        assert st.peer is not None
        batch = self.acks.get(st.transfer_id)
        if batch is None:
            batch = self.acks[st.transfer_id] = _AckBatch(st.peer.endpoint, st.peer.instance_id)
        if index is not None:
            batch.layers.append(index)
        batch.trailer = batch.trailer or trailer

    def flush_acks(self) -> None:
        """Control thread: one Ack per transfer with everything that arrived since the last flush."""
        batches, self.acks = self.acks, {}
        for tid, b in batches.items():
            self.core.send(
                b.endpoint,
                Ack(**self.core.header(b.endpoint, tid, b.dst_id), layers=b.layers, trailer=b.trailer),
            )

    # --- finished transfers ------------------------------------------------------------------------------

    def take_layers(self, transfer_id: str) -> dict[int, torch.Tensor]:
        bufs = self.done_layers.pop(transfer_id, None)
        specs = self.done_specs.pop(transfer_id, None)
        if bufs is None or specs is None:
            raise TransferError(f"no received layers for {transfer_id} (not finished, or taken)", transfer_id)
        out: dict[int, torch.Tensor] = {}
        for index, buf in bufs.items():
            out[index] = self.layer_view(buf, specs[index], owned=True)
            if buf.kind is BufferKind.SPILL:
                buf.release()  # copied out: the spill buffer goes back to the pool
            else:
                buf.hand_over()  # the caller owns this memory now
        self.receiver.credit.grant_pass()
        return out

    def take_trailer(self, transfer_id: str) -> bytes | None:
        return self.done_trailers.pop(transfer_id, None)

    def layer_view(self, buf: RecvBuffer, spec: LayerSpec, owned: bool) -> torch.Tensor:
        view = buf.view(spec.shape, spec.dtype)
        if buf.kind is BufferKind.SPILL:
            # spill buffers go back to the pool: hand out a copy on the agent's device
            device = torch.device(self.core.config.device)
            return view.to(device) if device.type != "cpu" else (view.clone() if owned else view)
        return view

    def drop_done(self, transfer_id: str) -> None:
        for buf in self.done_layers.pop(transfer_id, {}).values():
            buf.release()
        self.done_specs.pop(transfer_id, None)
        self.done_trailers.pop(transfer_id, None)

    def close(self) -> None:
        for tid in list(self.done_layers):
            self.drop_done(tid)


# ============================== The receive side

SIDE = "recv"
_SENDER_PROGRESS = frozenset({PeerState.QUEUED.value, PeerState.SENDING.value})


class UnsolicitedOffers:
    """Offers that came before ``expect()``: held (as transfers of the receiver's table) until the
    caller expects them or their lease ends; at most ``max_pending_per_peer`` per sender endpoint and
    ``max_pending_transfers`` transfers in all (decision 116)."""

    def __init__(self, core: Core, recvs: dict[str, RecvState]) -> None:
        self.core = core
        self.recvs = recvs
        # per sender endpoint: its Offers held here that expect() has not claimed yet
        self.counts: collections.Counter[str] = collections.Counter()

    def admit(self, msg: Offer, deadline_s: float) -> RecvState | None:
        """State for an Offer that came before expect(), unless this agent or that sender has too
        many (refused with an Abort)."""
        limit = None
        if len(self.recvs) >= self.core.config.max_pending_transfers:
            limit = ControlLimit.PENDING_TRANSFERS
        elif self.counts[msg.src_endpoint] >= self.core.config.limits.max_pending_per_peer:
            limit = ControlLimit.PENDING_PER_PEER
        if limit is not None:
            self.core.stats.limit_hit(limit)
            reason = f"receiver has too many transfers ({limit.value})"
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)
            return None
        lease = Lease.start(self.core.now(), deadline_s, self.core.config.default_limit_s)
        st = self.recvs[msg.transfer_id] = RecvState(msg.transfer_id, lease, unsolicited_by=msg.src_endpoint)
        self.counts[msg.src_endpoint] += 1
        return st

    def claim(self, st: RecvState) -> None:
        """``st`` no longer counts as its sender's unsolicited Offer (expected now, or ended)."""
        peer, st.unsolicited_by = st.unsolicited_by, None
        if peer is not None:
            self.counts[peer] -= 1
            if self.counts[peer] <= 0:
                del self.counts[peer]


class Receiver(Transfers[RecvState]):
    """Every method runs with ``core.lock`` held, except the sink calls the agent makes."""

    side = SIDE

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.credit = Credit(self)
        self.arrivals = Arrivals(self)
        self.unsolicited = UnsolicitedOffers(core, self.table)

    @property
    def recvs(self) -> dict[str, RecvState]:
        return self.table

    # --- API ---------------------------------------------------------------------------------------------

    def expect(
        self,
        transfer_id: str,
        num_layers: int,
        sink: LayerSink | None,
        deadline_s: float,
        pull_from: str | None,
        scatter_into: SpansFn | None = None,
        into_blocks: tuple[PagedKV, BlockTarget] | None = None,
        accept_from: str | None = None,
        sender: str | None = None,
        limit_s: float | None = None,
        pull_slice: PullSlice | None = None,
    ) -> bool:
        """Returns True when buffered layers must now be delivered to the new sink. Raises
        TransferError when the transfer was already offered by another agent than ``accept_from``
        (that transfer is failed: its data is never delivered)."""
        accept_from = accept_from or pull_from
        st = self._expected_state(transfer_id, num_layers, deadline_s, accept_from, limit_s)
        self.unsolicited.claim(st)
        st.expected, st.num_layers, st.sink, st.pull_from = True, num_layers, sink, pull_from
        st.accept_from = accept_from
        st.sender = sender if st.sender is None else st.sender
        if scatter_into is not None:
            st.scatter_into = scatter_into
            st.sink = lambda index, data: scatter_into(index).scatter(data)  # layers buffered already
        if into_blocks is not None:
            paged, target = st.paged, st.target = into_blocks
            st.guard = WriteGuard()
            st.sink = st.guard.wrap(lambda index, data: paged.write(index, target, data))  # copy path
        self.core.stats.add("recvs_started")
        if pull_from is not None and st.peer is None:
            self.core.send(pull_from, self._pull_msg(pull_from, transfer_id, deadline_s, pull_slice))
        if st.specs is not None and not self._check_offer(st):
            return False
        self.credit.grant_early(st)
        self.arrivals.maybe_complete(st)
        return bool(st.held) and st.sink is not None and transfer_id in self.table

    def _expected_state(
        self, transfer_id: str, num_layers: int, deadline_s: float, accept_from: str | None,
        limit_s: float | None,
    ) -> RecvState:  # fmt: skip
        """The state ``expect`` fills in: the one an Offer made already, or a new one."""
        if not transfer_id or num_layers <= 0:
            raise TransferError("expect needs a transfer_id and num_layers > 0", transfer_id)
        st = self.table.get(transfer_id)
        if st is not None and st.expected:
            raise TransferError(f"transfer {transfer_id} is already expected", transfer_id)
        if st is not None and st.peer is not None and accept_from and st.peer.endpoint != accept_from:
            self._refused(st.peer.endpoint, transfer_id)
            self.fail(transfer_id, f"{FailReason.REFUSED.value}: offered by an unexpected peer", notify=True)
            raise TransferError(f"transfer {transfer_id} was offered by {st.peer.endpoint}, not by "
                                f"its peer {accept_from}", transfer_id)  # fmt: skip
        now = self.core.now()
        if limit_s is None:
            limit_s = self.core.config.default_limit_s
        if st is None:
            if len(self.table) >= self.core.config.max_pending_transfers:
                raise TransferError("too many transfers in flight", transfer_id)
            st = self.table[transfer_id] = RecvState(transfer_id, Lease.start(now, deadline_s, limit_s), now)
        st.lease.tighten(now, deadline_s, limit_s)
        return st

    def _pull_msg(self, endpoint: str, transfer_id: str, deadline_s: float, piece: PullSlice | None) -> Pull:
        info = self.core.plane.local_info(PeerRef(endpoint, self.core.peer_ids.get(endpoint), ""))
        msg = Pull(**self.core.header(endpoint, transfer_id), deadline_s=deadline_s,
                   data_address=self.core.plane.address, plane_info=info)  # fmt: skip
        if piece is None:
            return msg
        heads = [] if piece.heads is None else [piece.heads.start, piece.heads.stop]
        return msgspec.structs.replace(msg, held=piece.held_id, heads=heads, pieces=piece.pieces)

    def release(self, held_id: str, endpoint: str, deadline_s: float) -> None:
        """A piece pull of nothing: the sender ends the held transfer (split_pull)."""
        self.core.send(endpoint, self._pull_msg(endpoint, held_id, deadline_s, PullSlice(held_id, None, 0)))

    def take_layers(self, transfer_id: str) -> dict[int, torch.Tensor]:
        return self.arrivals.take_layers(transfer_id)

    def take_trailer(self, transfer_id: str) -> bytes | None:
        return self.arrivals.take_trailer(transfer_id)

    # --- messages ----------------------------------------------------------------------------------------

    def on_control(self, msg: Offer | Trailer | Abort) -> None:
        """The control thread's one way in: a message for the receive side, by its type."""
        if isinstance(msg, Offer):
            self.on_offer(msg)
        elif isinstance(msg, Trailer):
            self.on_trailer(msg)
        else:
            self.on_abort(msg.transfer_id, msg.src_id, msg.reason, msg.src_endpoint)

    def on_offer(self, msg: Offer) -> None:
        tid = msg.transfer_id
        st = self.table.get(tid)
        if st is not None and st.accept_from is not None and msg.src_endpoint != st.accept_from:
            self._refused(msg.src_endpoint, tid)  # not the pair's sender: leave the transfer alone
            self.core.send_abort(msg.src_endpoint, tid, "not this transfer's peer", msg.src_id)
            return
        ended = self.core.tombstones.get(SIDE, tid)
        if (st is None and ended is not None) or (st is not None and st.specs is not None):
            if st is None:
                self.core.send_abort(msg.src_endpoint, tid, ended or "ended", msg.src_id)
            return  # a duplicate offer is ignored
        if len(msg.layers) > self.core.config.max_layers_per_transfer or not msg.layers:
            self.core.send_abort(
                msg.src_endpoint, tid, f"{FailReason.MISMATCH.value}: bad layer count", msg.src_id
            )
            return
        deadline_s = self.core.peer_deadline(msg.deadline_s)
        st = st if st is not None else self.unsolicited.admit(msg, deadline_s)
        if st is None or not self._offer_from_granted(st, msg):
            return
        st.lease.tighten(self.core.now(), deadline_s, None)
        st.specs = [LayerSpec(tuple(w.shape), DTYPES_BY_NAME[w.dtype]) for w in msg.layers]
        st.with_trailer = msg.with_trailer
        st.peer = PeerRef(msg.src_endpoint, msg.src_id, msg.data_address, msg.plane_info)
        if msg.plane_info:
            self.core.plane.on_peer_info(st.peer, msg.plane_info)
        if st.expected and not self._check_offer(st):
            return
        self.credit.offered(st)
        if st.early and tid in self.table:
            self.arrivals.maybe_complete(st)  # early-granted layers may all have landed before the Offer

    def _offer_from_granted(self, st: RecvState, msg: Offer) -> bool:
        """False (the transfer failed) when ``st`` was granted early to another sender than the
        Offer's (a restart was handled by ``fail_peer`` already)."""
        if not st.early or st.peer is None or st.peer.instance_id == msg.src_id:
            return True
        reason = (
            f"{FailReason.PEER_LOST.value}: offer from {msg.src_endpoint} (instance {msg.src_id[:8]}) "
            f"after an early grant to {st.peer.endpoint} (instance {st.peer.instance_id[:8]})"
        )
        self.fail(st.transfer_id, reason, notify=False)
        self.core.send_abort(msg.src_endpoint, st.transfer_id, reason, msg.src_id)
        return False

    def _refused(self, endpoint: str, transfer_id: str) -> None:
        self.core.stats.add("offers_refused")
        self.core.refusals.refused("wrong_peer", f"offer of transfer {transfer_id} from {endpoint}")

    def _check_offer(self, st: RecvState) -> bool:
        assert st.specs is not None
        if st.num_layers != len(st.specs):
            reason = (
                f"{FailReason.MISMATCH.value}: expected {st.num_layers} layers, sender offers {len(st.specs)}"
            )
            self.fail(st.transfer_id, reason, notify=True)
            return False
        total = sum(spec.num_bytes for spec in st.specs)
        if st.sink is None and total > self.core.memory.capacity_bytes:
            reason = f"{FailReason.BUDGET.value}: {total} bytes exceed receive budget + spill pool"
            self.fail(st.transfer_id, reason, notify=True)
            return False
        return True

    def on_trailer(self, msg: Trailer) -> None:
        st = self.table.get(msg.transfer_id)
        if st is None or st.peer is None or st.peer.instance_id != msg.src_id or st.trailer is not None:
            return
        st.trailer = msg.payload
        self.arrivals.ack(st, None, trailer=True)
        self.arrivals.maybe_complete(st)

    def on_abort(self, transfer_id: str, src_id: str, reason: str, src_endpoint: str = "") -> None:
        st = self.table.get(transfer_id)
        if st is None:
            return
        from_sender = st.peer is not None and st.peer.instance_id == src_id
        from_pulled = st.peer is None and st.pull_from is not None
        from_announced = st.peer is None and st.sender is not None and st.sender == src_endpoint
        if from_sender or from_pulled or from_announced:
            self.fail(transfer_id, f"{FailReason.PEER_ABORTED.value}: {reason}", notify=False)

    # --- failure -----------------------------------------------------------------------------------------

    def _released(self, st: RecvState) -> None:
        self.unsolicited.claim(st)
        if st.guard is not None:
            st.guard.close()  # a copy into the caller's blocks running now finishes first
        for granted in st.granted.values():
            if granted is not None:  # a posted receive may still land in it (NCCL: until the
                granted.hand_over()  # cancelled chunk's dummy bytes arrive): never hand it out again
        for buf in st.held.values():  # includes layers in a sink call now (their tensor stays alive)
            buf.release()
        self.arrivals.acks.pop(st.transfer_id, None)

    def _after_failure(self, st: RecvState, reason: str) -> None:
        self.credit.grant_pass()  # its memory went back to the budget

    def fail_peer(self, peer_id: str, reason: str, restarted: bool = False) -> None:
        """The sender ``peer_id`` is gone: fail its transfers, except those whose every layer already
        arrived (a push granted before the caller's ``expect``, held in receive buffers: the data
        is whole, so the ``expect`` that follows completes it; the lease still bounds the wait) and,
        when a new process ``restarted`` at its endpoint, those only granted early to the old one,
        which wait for the new one's Offer. (A broken link of a live sender fails those too: that
        sender may have kept the early grant, whose slot is revoked with the link.)"""
        for tid in self.bound_to(peer_id):
            st = self.table.get(tid)  # (failing one frees memory: the grant pass may fail another)
            if st is None:
                continue
            if restarted and st.early_only(peer_id):
                # the transfer waits for the new process's Offer as if never granted; the plane's
                # posts and grants for the old epoch go with ``drop_peer``, which follows
                self.credit.forget_early(st)
                st.peer = None
            elif not self._all_arrived(st):
                self.fail(tid, reason, notify=False)

    def fail_endpoint(self, endpoint: str, reason: str) -> int:
        """The sender at ``endpoint`` is gone: as :meth:`fail_peer`, by endpoint (also before its
        Offer: a pull, or a push whose sender was named). Returns how many receives failed."""
        failed = 0
        for tid in [t for t, st in self.table.items() if st.peer_endpoint() == endpoint]:
            st = self.table.get(tid)
            if st is not None and not self._all_arrived(st):
                failed += self.fail(tid, reason, notify=False)
        return failed

    def _all_arrived(self, st: RecvState) -> bool:
        """Every layer landed (delivered or held). A trailer still missing will never come from a
        peer that is gone: the transfer then completes without it (the consumer computes P's token)."""
        if not st.all_landed():
            return False
        if st.with_trailer and st.trailer is None:
            st.with_trailer = False
            self.core.stats.add("trailers_missing")
        self.arrivals.maybe_complete(st)
        return True

    def _expiring(self, st: RecvState) -> str | None:
        """Every layer arrived and only the trailer (P's first token) is missing: finish without it
        (the consumer computes that token itself) rather than fail the whole transfer."""
        if st.with_trailer and st.trailer is None:
            st.with_trailer = False
            if st.complete():
                self.core.stats.add("trailers_missing")
                self.arrivals.maybe_complete(st)
                return None
            st.with_trailer = True
        if st.specs is None:
            return "no offer received"
        return f"{len(st.arrived)}/{len(st.specs)} layers received"

    # --- leases ------------------------------------------------------------------------------------------

    def renew_msg(self, endpoint: str, transfer_id: str, reply: bool) -> Renew:
        return Renew(
            **self.core.header(endpoint, transfer_id), state=PeerState.RECEIVING.value, reply=reply
        )

    def on_renew(self, msg: Renew) -> bool:
        """The sender of ``msg.transfer_id`` is alive: extend the lease. True if the transfer is ours."""
        st = self.renewed_by(msg)
        if st is None:
            return False
        if msg.state not in _SENDER_PROGRESS and not self._admitting(st, msg):
            return True  # done, or does not know it: nothing more will come, no renewal
        if st.specs is None:  # before the Offer: the sender's epoch must not change meanwhile
            if st.sender_id is None:
                st.sender_id = msg.src_id
            elif st.sender_id != msg.src_id:
                self.fail(st.transfer_id, f"{FailReason.PEER_LOST.value}: sender restarted", notify=False)
                return True
        st.lease.renewed(self.core.now())
        return True

    def _admitting(self, st: RecvState, msg: Renew) -> bool:
        """A live push sender that has not heard of the transfer yet (its HTTP server or engine queue
        still holds the request: decision 128) renews the lease, within ``max_admission_wait_s`` of
        ``expect`` and before its Offer. Its epoch is pinned like a sender's in progress, so a
        restarted sender (which never had the request) fails the transfer."""
        if msg.state != PeerState.UNKNOWN.value or st.specs is not None or st.pull_from is not None:
            return False
        if not st.expected or st.sender is None:
            return False
        waited = self.core.now() - st.created_s
        if waited <= self.core.config.limits.max_admission_wait_s:
            self.core.stats.add("admission_renewals")
            return True
        return False

    def drop_done(self, transfer_id: str) -> None:
        self.arrivals.drop_done(transfer_id)

    def close(self, reason: str) -> None:
        super().close(reason)
        self.arrivals.close()
