"""State shared by the send and receive halves of one agent: lock, events, peers, memory, I/O; and the
base of both halves' transfers.

Each transfer is a small state object (:class:`TransferState`: its id and its :class:`Lease`; the send
side's :class:`~kvwire.transfer.send_state.SendState`, the receive side's
:class:`~kvwire.transfer.recv_state.RecvState`). :class:`Transfers` is the table of one side: it ends a
transfer as failed (:meth:`Transfers.fail`, the one place that does), expires those past their lease,
sends the Renews that are due and checks that a Renew comes from the transfer's peer. A side adds
what only it frees (buffers, slabs, pieces) through the ``_released``/``_after_failure`` hooks.
Every method runs with ``core.lock`` held (decisions 051, 092, 123).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvwire.http.refusal_log import RefusalLog
from kvwire.transfer.buffers import RecvMemory
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.control_messages import Abort, AnyMsg, Renew
from kvwire.transfer.enums import FailReason
from kvwire.transfer.lease import Lease, RunningClock
from kvwire.transfer.planes.base import DataPlane
from kvwire.transfer.stats import ControlLimit, StatsRecorder
from kvwire.transfer.types import PeerRef, TransferEvents, TransferTiming

if TYPE_CHECKING:
    from kvwire.transfer.control import ControlLoop

log = logging.getLogger("kvwire.transfer")

MAX_TOMBSTONES = 100_000


class EventBox:
    """Completion events, appended by any thread, swapped out atomically by ``poll()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # notified when an event is added
        self._sent: set[str] = set()
        self._recvd: set[str] = set()
        self._failed: dict[str, str] = {}
        self._timings: dict[str, TransferTiming] = {}

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

    def failed(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            self._failed.setdefault(transfer_id, reason)
            self._ready.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Block until an event is waiting to be swapped out, at most ``timeout_s``; True if one is."""
        with self._lock:
            return self._ready.wait_for(lambda: bool(self._sent or self._recvd or self._failed), timeout_s)

    def swap(self) -> TransferEvents:
        with self._lock:
            sent, recvd, failed, timings = self._sent, self._recvd, self._failed, self._timings
            self._sent, self._recvd, self._failed, self._timings = set(), set(), {}, {}
        return TransferEvents(frozenset(sent), frozenset(recvd), failed, timings)


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
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    events: EventBox = dataclasses.field(default_factory=EventBox)
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
        assert self.control is not None
        self.control.send(endpoint, msg)

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
        """A lease a peer chose (Offer/Pull ``deadline_s``) clamped to ``config.limits`` (counted)."""
        clamped = self.config.limits.peer_deadline(deadline_s)
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
