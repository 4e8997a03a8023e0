"""State shared by the send and receive halves of one agent: lock, events, peers, memory, I/O."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

from kvwire.refusal_log import RefusalLog
from kvwire.transfer.buffers import RecvMemory
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.lease import RunningClock
from kvwire.transfer.messages import Abort, AnyMsg
from kvwire.transfer.planes.base import DataPlane
from kvwire.transfer.stats import ControlLimit, StatsRecorder
from kvwire.transfer.types import TransferEvents, TransferTiming

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
