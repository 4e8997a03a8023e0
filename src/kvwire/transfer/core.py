"""The core of one transfer agent: what its send and receive halves share, the receive half built on
it, and the routes from the control thread and the data plane to the half that holds a transfer.

Read in order: the agent's counters; liveness leases and the lease clock; the shared core (lock,
peers, I/O) and ``Transfers``, the table of one side with the one ``fail``; the receive side (a
receive's state, credit, arrivals, the :class:`Receiver`); :class:`Routes`. The send side
(:mod:`kvwire.transfer.sender`) builds on the same base; the wire messages and their codec are
:mod:`kvwire.transfer.wire`; the control thread, the completion events and the public API are
:mod:`kvwire.transfer.agent`.

Why the receive side lives here (decision 145): on D's path to its first token, the receive side
uses the core's clock, leases, counters, tombstones, peer epochs, message header and send, and the
peer-deadline clamp, and the control thread's and the plane's reports reach it through the routes;
as calls between modules those were a dozen ways back into one module. In one module they are one
reading order, and D's path enters it three ways: ``expect``, a control message, a layer landed.

Counters
--------
Counters of one transfer agent (read with ``agent.stats()``; exported to Prometheus elsewhere).

Leases
------
Liveness leases: a transfer's deadline is renewed while its peer is alive, up to a hard limit.

Only a peer that knows the transfer renews it: the send side once the request was accepted
(:meth:`~kvwire.transfer.agent.TransferAgent.promise`, state QUEUED) or started and making
progress (SENDING: it handed a layer or the trailer over within the last lease, or has nothing left
to hand over; else STALLED), the receive side once it expects the transfer or holds its Offer
(RECEIVING). A peer that is alive but answers UNKNOWN (it never got the request) or STALLED (its
producer is stuck) renews nothing.

A transfer starts with ``deadline = now + lease_s`` (the caller's ``deadline_s``, e.g.
``--kv-deadline-s``) and ``limit = now + limit_s`` (the overall per-request bound). While it is in
flight each side sends its peer a :class:`~kvwire.transfer.wire.Renew` every
:func:`renew_interval` and answers the peer's Renews (a reply carries the transfer's state there,
or an Abort when the peer's side of it failed). Any Renew from the peer moves the deadline to
``min(limit, now + lease_s)``. So a dead or silent peer (killed, stopped, partitioned) still fails
the transfer within ``lease_s`` of its last sign of life, while a slow but alive one (a prefill
queued for a minute) does not, and nothing waits past ``limit``. See docs/decisions/051.

The shared core and the transfer table
--------------------------------------
State shared by the send and receive halves of one agent: lock, events, peers, memory, I/O; and the
base of both halves' transfers.

Each transfer is a small state object (:class:`TransferState`: its id and its :class:`Lease`; the send
side's :class:`~kvwire.transfer.sender.SendState`, the receive side's
:class:`RecvState`). :class:`Transfers` is the table of one side: it ends a
transfer as failed (:meth:`Transfers.fail`, the one place that does), expires those past their lease,
sends the Renews that are due and checks that a Renew comes from the transfer's peer. A side adds
what only it frees (buffers, slabs, pieces) through the ``_released``/``_after_failure`` hooks.
Every method runs with ``core.lock`` held (decisions 051, 092, 123).
A receive's state
-----------------
One transfer on the receive side: what was expected, offered, granted, landed and delivered.

Credit
------
A receiver grants a layer (a :class:`~kvwire.transfer.wire.Grant`) once it posted where the layer
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
:class:`Transfers`.

Routes
------
Where what reaches an agent goes: control messages, ticks and plane reports, to the side that
holds the transfer they name.

The control thread (:class:`~kvwire.transfer.agent.ControlLoop`) calls ``on_message``,
``on_reject``, ``on_tick``, ``on_unreachable`` and ``on_control_dead``; the data plane's threads call
the :class:`~kvwire.transfer.planes.base.PlaneCallbacks` methods. Each takes ``core.lock``; a sink
runs without it. Epochs are checked here, once per message, before any side sees it: a new instance
id at a known endpoint fails the old process's transfers (decision 092). Layers that landed before
``expect`` named their sink are handed to it by the control thread's tick (``on_tick``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import torch

from kvwire.errors import TransferError
from kvwire.http.refusal_log import RefusalLog
from kvwire.transfer.buffers import BufferKind, RecvBuffer, RecvMemory
from kvwire.transfer.config import TransferConfig
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
from kvwire.transfer.planes.base import DataPlane
from kvwire.transfer.wire import (
    Abort,
    Ack,
    AnyMsg,
    ControlLimit,
    Grant,
    Offer,
    Pull,
    Renew,
    Trailer,
)

if TYPE_CHECKING:
    from kvwire.transfer.agent import ControlLoop
    from kvwire.transfer.sender import Sender


# ============================== Counters

@dataclasses.dataclass(frozen=True)
class TransferStats:
    """A consistent snapshot of an agent's counters (monotonic since the agent started)."""

    sends_started: int = 0
    sends_completed: int = 0
    recvs_started: int = 0
    recvs_completed: int = 0
    failed: dict[str, int] = dataclasses.field(default_factory=dict)  # FailReason value | "other" -> count
    # control-plane limits hit (decision 116), by ControlLimit value: refused, clamped or forgotten
    limits_hit: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_rejected: int = 0  # malformed / unknown / old-version / unauthenticated messages
    offers_refused: int = 0  # offers (or pulls) from an agent other than the transfer's bound peer
    peers_restarted: int = 0  # new instance id seen at a known endpoint
    spilled_layers: int = 0  # layers that landed in the spill pool (receive budget full)
    credit_waits: int = 0  # times granting stopped because budget and spill pool were full
    early_grants: int = 0  # transfers granted at expect time, before the sender's Offer (decision 110)
    early_grants_unused: int = 0  # ... dropped: other sizes offered, or the sender restarted
    trailers_missing: int = 0  # transfers completed at their deadline without the sender's trailer
    # push receives renewed by a live sender that had not heard of them yet (decision 128)
    admission_renewals: int = 0
    device_copy_bytes: int = 0  # bytes a plane copied on the GPU itself (CUDA IPC) ...
    device_copy_ns: int = 0  # ... and the device time those copies took
    device_copy_batches: int = 0  # ... in this many batches (one timed window each)
    spill_bytes_in_use: int = 0  # gauges at snapshot time
    budget_bytes_in_use: int = 0
    transfers_active: int = 0
    quarantined_transfers: int = 0  # receives a stalled sender may still write into (decision 114)
    quarantined_bytes: int = 0  # ... and the destination bytes they keep out of use


class StatsRecorder:
    """Thread-safe counters behind :class:`TransferStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._limits: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def failed(self, reason: str) -> None:
        """Count a failure under its reason's prefix when that is a known ``FailReason`` value,
        else under "other" (caller-given abort reasons must not grow metric label sets)."""
        label = FailReason.of(reason).value
        with self._lock:
            self._failed[label] += 1

    def limit_hit(self, limit: ControlLimit | str) -> None:
        label = ControlLimit(limit).value
        with self._lock:
            self._limits[label] += 1

    def snapshot(self, **gauges: int) -> TransferStats:
        with self._lock:
            counts = dict(self._counts)
            failed = dict(self._failed)
            limits = dict(self._limits)
        fields = {f.name for f in dataclasses.fields(TransferStats)}
        values = {k: v for k, v in counts.items() if k in fields}
        return TransferStats(failed=failed, limits_hit=limits, **values, **gauges)


# ============================== Leases

MIN_RENEW_S = 0.05
MAX_RENEW_S = 5.0


class PeerState(str, enum.Enum):
    """What a Renew reports about the transfer on its sender's side."""

    UNKNOWN = "unknown"  # alive, but does not know the transfer (renews nothing)
    QUEUED = "queued"  # send side promised it: the request is queued or prefilling
    SENDING = "sending"  # send side started: offering, waiting for credit, sending layers
    STALLED = "stalled"  # send side started but handed over nothing for a whole lease (renews nothing)
    RECEIVING = "receiving"  # receive side expects it or holds an offer
    DONE = "done"  # this side finished it


def renew_interval(lease_s: float) -> float:
    """How often a side renews: four times per lease, within [MIN_RENEW_S, MAX_RENEW_S]."""
    return min(max(lease_s / 4.0, MIN_RENEW_S), MAX_RENEW_S)


@dataclasses.dataclass
class Lease:
    """The deadline of one transfer on one side (times are ``time.monotonic()``)."""

    deadline: float
    limit: float
    lease_s: float
    next_renew: float

    @classmethod
    def start(cls, now: float, lease_s: float, limit_s: float | None) -> Lease:
        limit = now + max(lease_s, limit_s if limit_s is not None else lease_s)
        return cls(now + lease_s, limit, lease_s, now + renew_interval(lease_s))

    def tighten(self, now: float, lease_s: float, limit_s: float | None) -> None:
        """A second announcement of the same transfer (offer vs expect): the stricter one wins."""
        self.lease_s = min(self.lease_s, lease_s)
        self.deadline = min(self.deadline, now + lease_s)
        if limit_s is not None:
            self.limit = min(self.limit, now + max(lease_s, limit_s))

    def renewed(self, now: float) -> None:
        """The peer showed life: extend the deadline by one lease, never past the limit."""
        self.deadline = max(self.deadline, min(self.limit, now + self.lease_s))

    def due(self, now: float) -> bool:
        """True (and schedules the next one) when this side should send its peer a Renew now."""
        if now < self.next_renew:
            return False
        self.next_renew = now + renew_interval(self.lease_s)
        return True


# A gap longer than this between two readings of a process's lease clock (its control loop reads it
# at least every TICK_S while it runs) is time the process did not run: stopped (SIGSTOP, a
# suspended VM) or starved of CPU. Decision 123.
PAUSE_GAP_S = 0.1


class RunningClock:
    """Monotonic seconds that leave out the time this process was not running (decision 123).

    Each side judges its peer's silence, and its own producer's progress, on this clock: a P stopped
    for most of a lease does not, once continued, count that stop against D's renewals it could not
    read, nor against its own prefill that could not run. A peer that is stopped or dead is still
    judged on the *other* side's clock, which runs: it fails within one lease as before. A gap
    between two readings beyond ``PAUSE_GAP_S`` counts only ``PAUSE_GAP_S``. Any thread."""

    def __init__(
        self, monotonic: Callable[[], float] = time.monotonic, pause_gap_s: float = PAUSE_GAP_S
    ) -> None:
        self._monotonic = monotonic
        self._pause_gap_s = pause_gap_s
        self._lock = threading.Lock()
        self._last = monotonic()
        self.paused_s = 0.0  # wall time left out so far

    def now(self) -> float:
        with self._lock:
            t = self._monotonic()
            gap = t - self._last
            if gap > self._pause_gap_s:
                self.paused_s += gap - self._pause_gap_s
            self._last = max(self._last, t)
            return t - self.paused_s


# ============================== The shared core and the transfer table

log = logging.getLogger("kvwire.transfer")

MAX_TOMBSTONES = 100_000


class CompletionEvents:
    """Completion events, appended by either half (any thread); the agent's
    :class:`~kvwire.transfer.agent.EventBox` swaps them out (``poll``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # notified when an event is added
        self._sent: set[str] = set()
        self._recvd: set[str] = set()
        self._failed: dict[str, str] = {}
        self._timings: dict[str, TransferTiming] = {}
        # Called (on the thread that appended, outside this object's lock but mostly inside the
        # agent's ``core.lock``: the control or a plane thread) after a receive ended or a transfer
        # failed: the host's engine loop steps at once instead of at its next poll (decision 153).
        # Set once at start-up; it must be quick, must not raise and must not wait for another
        # thread (it puts a command on a queue).
        self.listener: Callable[[], None] | None = None

    def sent(self, transfer_id: str, timing: TransferTiming | None = None) -> None:
        with self._lock:
            self._sent.add(transfer_id)
            if timing is not None:
                self._timings[transfer_id] = timing
            self._ready.notify_all()

    def recvd(self, transfer_id: str, timing: TransferTiming | None = None) -> None:
        with self._lock:
            self._recvd.add(transfer_id)
            if timing is not None:
                self._timings[transfer_id] = timing
            self._ready.notify_all()
        self._tell_listener()

    def failed(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            self._failed.setdefault(transfer_id, reason)
            self._ready.notify_all()
        self._tell_listener()

    def _tell_listener(self) -> None:
        listener = self.listener
        if listener is not None:
            listener()


class Tombstones:
    """Recently ended transfers (bounded): late messages for them are answered or ignored, never
    resurrect state."""

    def __init__(self) -> None:
        self._ended: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()

    def add(self, side: str, transfer_id: str, outcome: str) -> None:
        self._ended[(side, transfer_id)] = outcome
        self._ended.move_to_end((side, transfer_id))
        while len(self._ended) > MAX_TOMBSTONES:
            self._ended.popitem(last=False)

    def get(self, side: str, transfer_id: str) -> str | None:
        return self._ended.get((side, transfer_id))


class PeerIds:
    """Peer control endpoint -> the instance id (epoch) last heard from it; at most ``max_peers``, the
    least recently heard of forgotten first (a peer chooses its ``src_endpoint``: spoofed endpoints
    must not grow this). Forgetting costs little: the next message from that peer is its "first"
    (no restart detected by epoch; its transfers still end by their leases or a broken link), and
    messages to it name no epoch until it is heard of again."""

    def __init__(self, max_peers: int, stats: StatsRecorder) -> None:
        self._ids: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._max = max_peers
        self._stats = stats

    def get(self, endpoint: str) -> str:
        """The epoch known for ``endpoint`` ("" when unknown)."""
        return self._ids.get(endpoint, "")

    def endpoint_of(self, instance_id: str) -> str | None:
        """The endpoint whose current epoch is ``instance_id`` (None: none now). A scan: called once
        per data link, on its hello."""
        return next((e for e, i in self._ids.items() if i == instance_id), None)

    def heard(self, endpoint: str, instance_id: str) -> str | None:
        """``instance_id`` was heard at ``endpoint``: remember it (most recent); returns the id known
        before (None: first contact, or forgotten)."""
        known = self._ids.get(endpoint)
        self._ids[endpoint] = instance_id
        self._ids.move_to_end(endpoint)
        while len(self._ids) > self._max:
            self._ids.popitem(last=False)
            self._stats.limit_hit(ControlLimit.PEERS)
        return known

    def __len__(self) -> int:
        return len(self._ids)


@dataclasses.dataclass
class Core:
    """What both halves share. ``lock`` guards every field of both halves' transfer tables."""

    config: TransferConfig
    instance_id: str
    plane: DataPlane
    memory: RecvMemory
    events: CompletionEvents  # what ``poll`` reports (the agent's EventBox: appended here, swapped out there)
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    stats: StatsRecorder = dataclasses.field(default_factory=StatsRecorder)
    tombstones: Tombstones = dataclasses.field(default_factory=Tombstones)
    peer_ids: PeerIds = dataclasses.field(init=False)  # endpoint -> instance id (bounded)
    # Offers from an agent a transfer is not bound to: logged once per minute, not per message.
    refusals: RefusalLog = dataclasses.field(default_factory=lambda: RefusalLog(log, "transfer message"))
    # Control messages that do not decode, authenticate or validate: the same, per kind of refusal.
    rejects: RefusalLog = dataclasses.field(default_factory=lambda: RefusalLog(log, "control message"))
    control: ControlLoop | None = None
    closed: bool = False
    dead: str | None = None  # the control loop gave up (supervision): why; nothing moves any more
    clock: RunningClock = dataclasses.field(default_factory=RunningClock)

    def __post_init__(self) -> None:
        self.peer_ids = PeerIds(self.config.limits.max_peers, self.stats)

    @property
    def endpoint(self) -> str:
        assert self.control is not None
        return self.control.endpoint

    def header(self, dst_endpoint: str, transfer_id: str, dst_id: str | None = None) -> dict[str, Any]:
        """Common message fields for a message to ``dst_endpoint``."""
        return {
            "src_id": self.instance_id,
            "src_endpoint": self.endpoint,
            "dst_id": dst_id if dst_id is not None else self.peer_ids.get(dst_endpoint),
            "transfer_id": transfer_id,
        }

    def send(self, endpoint: str, msg: AnyMsg) -> None:
        """Queue ``msg`` for the control thread and wake it (any thread): the loop's outbox and waker
        are used here directly, so that sending is no call back into the agent's module (decision 143)."""
        control = self.control
        assert control is not None
        control.outbox.append((endpoint, msg))
        self.wake()

    def wake(self) -> None:
        """Wake the control thread (any thread; nothing when it is not built yet): its waker socket,
        written here as ``ControlLoop.wake`` does, so that this is no call into the agent's module."""
        control = self.control
        if control is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                control.waker.send(b"\0")

    def send_abort(self, endpoint: str, transfer_id: str, reason: str, dst_id: str | None = None) -> None:
        self.send(endpoint, Abort(**self.header(endpoint, transfer_id, dst_id), reason=reason))

    def record_failure(self, side: str, transfer_id: str, reason: str, label: str | None = None) -> None:
        """Report a failed transfer once (caller holds ``lock`` and removed the state). ``label``:
        the stats label when the reason text is the caller's (local abort)."""
        self.events.failed(transfer_id, reason)
        self.stats.failed(label or reason)
        self.tombstones.add(side, transfer_id, reason)
        log.info("transfer %s (%s) failed: %s", transfer_id, side, reason)

    def peer_deadline(self, deadline_s: float) -> float:
        """A lease a peer chose (Offer/Pull ``deadline_s``: finite, > 0, the codec checked) clamped to
        ``config.limits`` (counted)."""
        limits = self.config.limits
        clamped = min(max(deadline_s, limits.min_peer_deadline_s), limits.max_peer_deadline_s)
        if clamped != deadline_s:
            self.stats.limit_hit(ControlLimit.PEER_DEADLINE)
        return clamped

    def now(self) -> float:
        """The lease clock: monotonic, less the time this process was not running (decision 123)."""
        return self.clock.now()


@dataclasses.dataclass
class TransferState:
    """One transfer on one side: its id, its lease and, once bound, its peer."""

    transfer_id: str
    lease: Lease  # deadline, renewed while the peer shows life, up to its limit

    @property
    def bound_peer(self) -> PeerRef | None:
        """The peer (epoch + data address) the transfer is bound to; None until it is."""
        return None

    def peer_endpoint(self) -> str | None:
        """The control endpoint of the peer this side renews and tells of a failure (None: unknown)."""
        raise NotImplementedError

    def abort_endpoint(self) -> str | None:
        """Where a failure of this transfer is told (None: nowhere)."""
        return self.peer_endpoint()

    def expired(self, now: float) -> bool:
        return self.lease.deadline <= now


S = TypeVar("S", bound=TransferState)


class Transfers(Generic[S]):
    """The transfers of one side (``side``: "send" or "recv", the tombstones' key), by id."""

    side: str

    def __init__(self, core: Core) -> None:
        self.core = core
        self.table: dict[str, S] = {}

    # --- failure -----------------------------------------------------------------------------------------

    def fail(
        self,
        transfer_id: str,
        reason: str,
        notify: bool,
        label: str | None = None,
        wire_reason: str | None = None,
    ) -> bool:
        """End the transfer as failed with ``reason``; ``notify``: tell the peer (``wire_reason``, if
        given, is what it is told; the local reason otherwise). False: no such transfer here."""
        st = self.table.pop(transfer_id, None)
        if st is None:
            return False
        self.core.plane.cancel(transfer_id)
        self._released(st)
        self.core.record_failure(self.side, transfer_id, reason, label)
        endpoint = st.abort_endpoint()
        if notify and endpoint is not None:
            peer = st.bound_peer
            dst = peer.instance_id if peer is not None else None
            self.core.send_abort(endpoint, transfer_id, wire_reason or reason, dst)
        self._after_failure(st, reason)
        return True

    def _released(self, st: S) -> None:
        """Free what ``st`` holds (it left the table, the plane cancelled it; before it is reported)."""

    def _after_failure(self, st: S, reason: str) -> None:
        """What follows a failure on this side (the failure was reported and the peer told)."""

    def close(self, reason: str) -> None:
        """Fail every transfer in flight, telling each peer."""
        for tid in list(self.table):
            self.fail(tid, reason, notify=True)

    # --- leases ------------------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Fail (telling the peer) every transfer whose lease ended, unless the side keeps it."""
        for tid in [t for t, st in self.table.items() if st.expired(now)]:
            st = self.table.get(tid)  # (failing one may end another: a split's pieces)
            if st is None:
                continue
            what = self._expiring(st)
            if what is not None:
                self.fail(tid, f"{FailReason.DEADLINE.value}: {what}", notify=True)

    def _expiring(self, st: S) -> str | None:
        """``st``'s lease ended: what it lacks (the failure reason), or None when it ends otherwise."""
        raise NotImplementedError

    def renew(self, now: float) -> None:
        """Send a Renew to the peer of every transfer whose renewal is due (and whose peer is known)."""
        for st in self.table.values():
            endpoint = st.peer_endpoint()
            if endpoint is not None and st.lease.due(now):
                self.core.send(endpoint, self.renew_msg(endpoint, st.transfer_id, reply=False))

    def renew_msg(self, endpoint: str, transfer_id: str, reply: bool) -> Renew:
        """This side's Renew of ``transfer_id`` (its state here) to ``endpoint``."""
        raise NotImplementedError

    def renewed_by(self, msg: Renew) -> S | None:
        """The transfer ``msg`` renews, when it comes from that transfer's peer (its endpoint, and its
        epoch once bound); None otherwise (an older or newer epoch: the epoch checks handle it)."""
        st = self.table.get(msg.transfer_id)
        if st is None or st.peer_endpoint() != msg.src_endpoint:
            return None
        peer = st.bound_peer
        if peer is not None and peer.instance_id != msg.src_id:
            return None
        return st

    def bound_to(self, peer_id: str) -> list[str]:
        """The ids of the transfers bound to the peer epoch ``peer_id``."""
        return [t for t, st in self.table.items() if st.bound_peer and st.bound_peer.instance_id == peer_id]

    def __len__(self) -> int:
        return len(self.table)


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
    # ... and its whole size once granted any receive memory (against max_unexpected_bytes_per_peer)
    unsolicited_bytes: int = 0

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

    def offered(self, st: RecvState, early_grant_used: bool = False) -> None:
        """The Offer of ``st`` was taken: queue its layers not granted early, and grant what fits.
        ``early_grant_used``: the sender said it sends under this side's early grant."""
        assert st.specs is not None
        if st.early:
            self._check_early(st, early_grant_used)
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
                if st.transfer_id in self.receiver.unsolicited.parked:
                    self.queue.popleft()  # waits for expect(), which queues it again; others go on
                    continue
                return  # out of memory: later transfers wait too (FIFO, no starvation)

    def resume(self, st: RecvState) -> None:
        """``st``, parked while not expected (decision 150), is expected now: queue its layers again."""
        self.queue.append(st.transfer_id)
        self.grant_pass()

    def _grantable(self, st: RecvState, specs: list[LayerSpec]) -> list[RecvItem]:
        """Take layers off ``st.to_grant`` while each has somewhere to land; stop at the first that
        has not (out of memory) or when the transfer failed."""
        memory, unsolicited = self.core.memory, self.receiver.unsolicited
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
            if not unsolicited.fits(st):
                unsolicited.park(st)  # its sender's Offers not expected yet hold enough: wait for expect()
                break
            buf = memory.reserve(num_bytes)
            if buf is None:
                self.core.stats.add("credit_waits")
                break
            unsolicited.took(st)
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

    def _check_early(self, st: RecvState, early_grant_used: bool = False) -> None:
        """The Offer of an early-granted transfer. Layers the sizes granted: the grant is sent again
        as an ordinary one (a sender that did not keep it gets it now), unless the Offer says the
        sender uses it (``early_grant_used``, decision 165: it would find nothing new in it). Other
        sizes (P sends more blocks than D takes, say): the sender did not use the grant (it checks
        the sizes), so nothing was written under it; the layers are granted afresh, the ordinary
        way, and the new posts replace the early ones."""
        assert st.specs is not None and st.peer is not None
        fits = all(
            index < len(st.specs) and st.specs[index].num_bytes == num_bytes
            for index, num_bytes in st.early.items()
        )
        if not fits:
            self.forget_early(st)
            return
        grant, st.early_grant = st.early_grant, None
        if grant is not None and not early_grant_used:
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
        # expected transfers whose layers landed before ``expect`` named a sink: the control thread
        # delivers them (appended under the lock, taken by that one thread)
        self.to_deliver: collections.deque[str] = collections.deque()

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

RECV_SIDE = "recv"  # the receive side's key in the tombstones
_SENDER_PROGRESS = frozenset({PeerState.QUEUED.value, PeerState.SENDING.value})


def _offered_bytes(st: RecvState) -> int:
    """The bytes of every layer ``st``'s Offer announced."""
    assert st.specs is not None
    return sum(spec.num_bytes for spec in st.specs)


class UnsolicitedOffers:
    """Offers that came before ``expect()``: held (as transfers of the receiver's table) until the
    caller expects them or their lease ends; at most ``max_pending_per_peer`` per sender endpoint and
    ``max_pending_transfers`` transfers in all (decision 116).

    They are granted receive memory like expected ones (the Offer may beat ``expect``: decision
    110's race), up to ``TransferConfig.unexpected_bytes_per_peer`` per sender endpoint (decision
    150), each counted whole from its first grant. An Offer whose whole size would pass it is
    *parked* before any of it is granted: out of the credit queue (it blocks no one), its layers not
    granted until ``expect`` claims it and queues it again (``Credit.resume``), or its lease ends. A
    peer that offers and never sends holds at most that much memory.

    Each is kept at most ``ControlLimits.max_unsolicited_wait_s`` from its arrival, whatever its
    sender renews (decision 159): a parked Offer is renewed both ways (the sender's ``sending``, this
    side's ``receiving``) and would otherwise hold the sender's blocks up to its limit."""

    def __init__(self, core: Core, recvs: dict[str, RecvState]) -> None:
        self.core = core
        self.recvs = recvs
        # per sender endpoint: its Offers held here that expect() has not claimed yet ...
        self.counts: collections.Counter[str] = collections.Counter()
        # ... and the receive memory granted to them (each one's whole size from its first grant)
        self.granted_bytes: collections.Counter[str] = collections.Counter()
        self.parked: set[str] = set()  # transfer ids waiting for expect() to be granted more
        self.max_bytes_per_peer = core.config.unexpected_bytes_per_peer  # checked once per Offer
        # transfer id -> when its Offer came (the core's clock), in arrival order, until claimed
        self.arrived: dict[str, float] = {}
        self.max_wait_s = core.config.limits.max_unsolicited_wait_s

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
        now = self.core.now()
        lease = Lease.start(now, deadline_s, self.core.config.default_limit_s)
        st = self.recvs[msg.transfer_id] = RecvState(msg.transfer_id, lease, unsolicited_by=msg.src_endpoint)
        self.counts[msg.src_endpoint] += 1
        self.arrived[msg.transfer_id] = now
        return st

    def fits(self, st: RecvState) -> bool:
        """Whether ``st`` may be granted receive memory: always once expected; before, when its
        whole size counts against its sender's cap already or fits under it. All or nothing: an
        Offer parked half granted would hold memory that transfers granted after it may need to
        complete (layers kept for ``take_layers``), while it waits behind them once expected."""
        peer = st.unsolicited_by
        if peer is None or st.unsolicited_bytes:
            return True
        return self.granted_bytes[peer] + _offered_bytes(st) <= self.max_bytes_per_peer

    def took(self, st: RecvState) -> None:
        """``st`` was granted receive memory: its whole size counts against its sender's cap."""
        peer = st.unsolicited_by
        if peer is not None and not st.unsolicited_bytes:
            st.unsolicited_bytes = _offered_bytes(st)
            self.granted_bytes[peer] += st.unsolicited_bytes

    def park(self, st: RecvState) -> None:
        """``st`` waits for ``expect()`` (counted once, logged once per minute)."""
        if st.transfer_id not in self.parked:
            self.parked.add(st.transfer_id)
            self.core.stats.limit_hit(ControlLimit.UNEXPECTED_BYTES_PER_PEER)
            detail = f"offer of {st.transfer_id} from {st.unsolicited_by}: no more credit until expected"
            self.core.refusals.refused(ControlLimit.UNEXPECTED_BYTES_PER_PEER.value, detail)

    def claim(self, st: RecvState) -> bool:
        """``st`` no longer counts as its sender's unsolicited Offer (expected now, or ended).
        True: it was parked (its layers wait to be queued again)."""
        self.arrived.pop(st.transfer_id, None)
        peer, st.unsolicited_by = st.unsolicited_by, None
        if peer is not None:
            self.counts[peer] -= 1
            if self.counts[peer] <= 0:
                del self.counts[peer]
            self.granted_bytes[peer] -= st.unsolicited_bytes
            if self.granted_bytes[peer] <= 0:
                del self.granted_bytes[peer]
            st.unsolicited_bytes = 0
        if st.transfer_id in self.parked:
            self.parked.discard(st.transfer_id)
            return True
        return False

    def overdue(self, now: float) -> list[str]:
        """The Offers that came ``max_unsolicited_wait_s`` or more before ``now`` and are not claimed
        (oldest first: the scan stops at the first younger one)."""
        out = []
        for transfer_id, since in self.arrived.items():
            if now - since < self.max_wait_s:
                break
            out.append(transfer_id)
        return out

    def expire(self, receiver: Receiver, now: float) -> None:
        """Fail every Offer nobody expected within ``max_unsolicited_wait_s``, telling its sender
        (its send fails: its blocks are freed); counted and logged (once, then a summary a minute)."""
        for transfer_id in self.overdue(now):
            st = self.recvs.get(transfer_id)
            if st is None:  # (failing one may have ended another)
                continue
            self.core.stats.limit_hit(ControlLimit.UNSOLICITED_WAIT)
            detail = f"offer of {transfer_id} from {st.unsolicited_by}: not expected in {self.max_wait_s:g} s"
            self.core.refusals.refused(ControlLimit.UNSOLICITED_WAIT.value, detail)
            receiver.fail(transfer_id, self.reason(), notify=True)

    def reason(self) -> str:
        """Why such an Offer failed (here, to its sender, and to a late ``expect``)."""
        what = f"offer not expected within {self.max_wait_s:g} s of its arrival (max_unsolicited_wait_s)"
        return f"{FailReason.DEADLINE.value}: {what}"

    def check_not_expired(self, transfer_id: str) -> None:
        """Raise ``TransferError`` when ``transfer_id``'s Offer came and was failed here for not being
        expected in time: no Offer will come again (its sender's send failed)."""
        if transfer_id in self.recvs:
            return
        ended = self.core.tombstones.get(RECV_SIDE, transfer_id)
        if ended is not None and ended == self.reason():
            raise TransferError(ended, transfer_id)


class Receiver(Transfers[RecvState]):
    """Every method runs with ``core.lock`` held, except the sink calls the agent makes."""

    side = RECV_SIDE

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.credit = Credit(self)
        self.arrivals = Arrivals(self)
        self.unsolicited = UnsolicitedOffers(core, self.table)

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
        """Returns True when buffered layers must now be delivered to the new sink (queued for the
        control thread, which the caller wakes). Raises
        TransferError when the transfer was already offered by another agent than ``accept_from``
        (that transfer is failed: its data is never delivered), or when its Offer came and was failed
        for not being expected within ``max_unsolicited_wait_s`` (decision 159)."""
        accept_from = accept_from or pull_from
        self.unsolicited.check_not_expired(transfer_id)
        st = self._expected_state(transfer_id, num_layers, deadline_s, accept_from, limit_s)
        parked = self.unsolicited.claim(st)
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
        if parked:
            self.credit.resume(st)
        self.credit.grant_early(st)
        self.arrivals.maybe_complete(st)
        deliver = bool(st.held) and st.sink is not None and transfer_id in self.table
        if deliver:  # the control thread hands them to the sink (Routes.on_tick)
            self.arrivals.to_deliver.append(transfer_id)
        return deliver

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
        ended = self.core.tombstones.get(RECV_SIDE, tid)
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
        self.credit.offered(st, msg.early_grant_used)
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
        from_pulled = st.peer is None and st.pull_from is not None and st.pull_from == src_endpoint
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

    def expire(self, now: float) -> None:
        super().expire(now)
        self.unsolicited.expire(self, now)

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

    def close(self, reason: str) -> None:
        super().close(reason)
        self.arrivals.close()


# ============================== Routes

TICK_S = 0.02  # deadline/ack-flush granularity (the control loop wakes at least this often)


class Routes:
    """The agent's control-thread and plane-thread entry points (see the module docstring)."""

    def __init__(self, core: Core, sender: Sender, receiver: Receiver) -> None:
        self.core = core
        self.sender = sender
        self.receiver = receiver
        self._next_expiry = 0.0  # control thread only: when on_tick next checks deadlines

    # --- control thread ----------------------------------------------------------------------------------

    def on_message(self, msg: AnyMsg) -> None:
        core = self.core
        with core.lock:
            if core.closed:
                return
            self._check_epoch(msg)
            if msg.dst_id and msg.dst_id != core.instance_id and not isinstance(msg, (Offer, Pull)):
                self.on_reject(f"stale {type(msg).__name__} for epoch {msg.dst_id} (now {core.instance_id})")
                # an early Grant (decision 110) went to this endpoint's previous process on what
                # the receiver knew of it: that process never had the transfer, nothing was lost;
                # the receiver grants afresh when this process offers it
                if not isinstance(msg, Abort) and not (isinstance(msg, Grant) and msg.early):
                    reason = f"{FailReason.PEER_LOST.value}: peer restarted"
                    core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)
                return
            self._route(msg)

    def _route(self, msg: AnyMsg) -> None:
        if isinstance(msg, (Offer, Trailer)):
            self.receiver.on_control(msg)
        elif isinstance(msg, Grant):
            self.sender.on_grant(msg)
        elif isinstance(msg, Ack):
            self.sender.on_ack(msg)
        elif isinstance(msg, Pull):
            self.sender.on_pull(msg)
        elif isinstance(msg, Renew):
            self._on_renew(msg)
        elif isinstance(msg, Abort):
            self.sender.on_abort(msg.transfer_id, msg.src_endpoint, msg.reason)
            self.receiver.on_control(msg)

    def _on_renew(self, msg: Renew) -> None:
        """The peer is alive: extend our lease on the transfer; answer a non-reply with our state."""
        core, tid, endpoint = self.core, msg.transfer_id, msg.src_endpoint
        sending = self.sender.on_renew(msg)
        promised = self.sender.promises.renewed_by(msg)
        self.sender.early_grants.heard(msg)
        receiving = self.receiver.on_renew(msg)
        if msg.reply:
            return
        if promised and not sending:
            state = PeerState.QUEUED.value
            core.send(endpoint, Renew(**core.header(endpoint, tid, msg.src_id), state=state, reply=True))
            return
        if sending:
            core.send(endpoint, self.sender.renew_msg(endpoint, tid, reply=True))
            return
        if receiving:
            core.send(endpoint, self.receiver.renew_msg(endpoint, tid, reply=True))
            return
        # the asker receives if it reports so: our side of the transfer is then the send side
        side = self.sender.side if msg.state == PeerState.RECEIVING.value else self.receiver.side
        ended = core.tombstones.get(side, tid)
        if ended is not None and ended != "done":
            core.send_abort(endpoint, tid, ended, msg.src_id)
            return
        state = PeerState.DONE if ended == "done" else PeerState.UNKNOWN
        core.send(endpoint, Renew(**core.header(endpoint, tid, msg.src_id), state=state.value, reply=True))

    def _check_epoch(self, msg: AnyMsg) -> None:
        """A new instance id at a known endpoint: the old process is gone; fail its transfers."""
        core = self.core
        known = core.peer_ids.heard(msg.src_endpoint, msg.src_id)
        if known is None or known == msg.src_id:
            return
        log.warning("peer %s restarted (instance %s -> %s)", msg.src_endpoint, known, msg.src_id)
        core.stats.add("peers_restarted")
        reason = f"{FailReason.PEER_LOST.value}: peer {msg.src_endpoint} restarted"
        self._fail_peer(known, reason, restarted=True)

    def _fail_peer(self, peer_id: str, reason: str, restarted: bool = False) -> None:
        """``restarted``: a new process took the peer's endpoint (not a link of a live peer that broke)."""
        self.sender.fail_peer(peer_id, reason)
        self.receiver.fail_peer(peer_id, reason, restarted)
        self.core.plane.drop_peer(peer_id)

    def on_unreachable(self, endpoint: str) -> None:
        """The peer at ``endpoint`` refuses connections (its process is gone): fail its transfers
        now rather than at their leases (peer_watch, decision 088)."""
        with self.core.lock:
            if self.core.closed:
                return
            reason = f"{FailReason.PEER_LOST.value}: {endpoint} refuses connections"
            failed = self.sender.fail_endpoint(endpoint, reason)
            failed += self.receiver.fail_endpoint(endpoint, reason)
        if failed:
            log.warning("transfer peer %s refuses connections: failed its %d transfer(s)", endpoint, failed)

    def on_reject(self, reason: str) -> None:
        self.core.stats.add("messages_rejected")
        # once, then a summary a minute: a peer sending garbage in a loop must not flood the log
        self.core.rejects.refused("rejected", reason)

    def on_tick(self) -> None:
        """After every control-loop wake-up: flush acks; scan deadlines at most every ``TICK_S``
        (each arrived layer wakes the loop, and the scans walk every transfer in flight); hand the
        layers buffered before ``expect`` to the sink it named."""
        with self.core.lock:
            if self.core.closed:
                return
            now = self.core.now()
            if now >= self._next_expiry:
                self._next_expiry = now + TICK_S
                self.sender.expire(now)
                self.receiver.expire(now)
                self.sender.renew(now)
                self.receiver.renew(now)
            self.receiver.arrivals.flush_acks()
        deliveries = self.receiver.arrivals.to_deliver
        while deliveries:
            self.deliver_held(deliveries.popleft())

    def on_control_dead(self, error: BaseException) -> None:
        """Control thread, once, as supervision gives it up: nothing can move or expire any more, so
        every transfer fails now (callers see it in ``poll``) and new ones are refused."""
        what = f"{type(error).__name__}: {error}"
        reason = f"{FailReason.CLOSED.value}: the transfer control loop is dead ({what})"
        log.error("transfer agent %s: %s; failing every transfer in flight", self.core.instance_id, reason)
        with self.core.lock:
            if self.core.closed:
                return
            self.core.dead = reason
            self.sender.close(reason)
            self.receiver.close(reason)

    def deliver_held(self, transfer_id: str) -> None:
        """Control thread: hand the layers buffered before ``expect`` to the sink it named."""
        with self.core.lock:
            work = self.receiver.arrivals.take_held_for_sink(transfer_id)
        for index, sink, tensor in work:
            self._run_sink(transfer_id, index, sink, tensor)

    def _run_sink(self, transfer_id: str, index: int, sink: LayerSink, tensor: torch.Tensor) -> None:
        try:
            sink(index, tensor)
            if tensor.is_cuda:  # the sink's copy/scatter is async: finish it before the buffer is reused
                done = torch.cuda.Event()  # and before finished_recving (only the sink's work: the
                done.record(torch.cuda.current_stream(tensor.device))  # plane's streams may hold
                done.synchronize()  # receives still waiting for data)
        except Exception as exc:
            log.exception("sink of transfer %s failed on layer %d", transfer_id, index)
            with self.core.lock:
                self.receiver.fail(transfer_id, f"{FailReason.SINK.value}: {exc!r}", notify=True)
            return
        with self.core.lock:
            self.receiver.arrivals.delivered(transfer_id, index)

    # --- data-plane callbacks (plane threads): PlaneCallbacks -------------------------------------------

    def on_sent(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        with self.core.lock:
            for index in layer_indices:
                self.sender.queue.on_sent(transfer_id, index)

    def on_received(self, peer_instance_id: str, transfer_id: str, layer_indices: Sequence[int]) -> None:
        sinks = []
        with self.core.lock:  # once per message (a plane's thread holds the GIL meanwhile)
            if self.core.closed:
                return
            for index in layer_indices:
                work = self.receiver.arrivals.on_received(peer_instance_id, transfer_id, index)
                if work is not None:
                    sinks.append((index, *work))
        self.core.wake()  # flush the acks soon
        for index, sink, tensor in sinks:
            self._run_sink(transfer_id, index, sink, tensor)

    def on_transfer_failed(self, transfer_id: str, reason: str) -> None:
        with self.core.lock:
            self.sender.fail(transfer_id, reason, notify=True)
            self.receiver.fail(transfer_id, reason, notify=True)

    def on_peer_failed(self, peer_instance_id: str, reason: str) -> None:
        with self.core.lock:
            if not self.core.closed:
                self._fail_peer(peer_instance_id, reason)

    def on_protocol_error(self, reason: str) -> None:
        self.on_reject(reason)

    def peer_endpoint(self, peer_instance_id: str) -> str | None:
        with self.core.lock:
            return self.core.peer_ids.endpoint_of(peer_instance_id)

    def on_device_copy(self, num_bytes: int, seconds: float) -> None:
        self.core.stats.add("device_copy_bytes", num_bytes)
        self.core.stats.add("device_copy_ns", round(seconds * 1e9))
        self.core.stats.add("device_copy_batches", 1)
