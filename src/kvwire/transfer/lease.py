"""Liveness leases: a transfer's deadline is renewed while its peer is alive, up to a hard limit.

Only a peer that knows the transfer renews it: the send side once the request was accepted
(:meth:`~kvwire.transfer.agent.TransferAgent.promise`, state QUEUED) or started and making
progress (SENDING: it handed a layer or the trailer over within the last lease, or has nothing left
to hand over; else STALLED), the receive side once it expects the transfer or holds its Offer
(RECEIVING). A peer that is alive but answers UNKNOWN (it never got the request) or STALLED (its
producer is stuck) renews nothing.

A transfer starts with ``deadline = now + lease_s`` (the caller's ``deadline_s``, e.g.
``--kv-deadline-s``) and ``limit = now + limit_s`` (the overall per-request bound). While it is in
flight each side sends its peer a :class:`~kvwire.transfer.control_messages.Renew` every
:func:`renew_interval` and answers the peer's Renews (a reply carries the transfer's state there,
or an Abort when the peer's side of it failed). Any Renew from the peer moves the deadline to
``min(limit, now + lease_s)``. So a dead or silent peer (killed, stopped, partitioned) still fails
the transfer within ``lease_s`` of its last sign of life, while a slow but alive one (a prefill
queued for a minute) does not, and nothing waits past ``limit``. See docs/decisions/051.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvwire.errors import TransferError
from kvwire.transfer.control_messages import Renew

if TYPE_CHECKING:
    from kvwire.transfer.core import Core

MIN_RENEW_S = 0.05
_SEND = "send"  # the send side's tombstones (a promise is the send side's)
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


class Promises:
    """Promised transfers: accepted by the send side, not started yet (their prefill may be queued).

    :meth:`~kvwire.transfer.agent.TransferAgent.promise` keeps one here until ``start_send``,
    ``abort`` or its limit; meanwhile the receiver's lease on it is renewed (state QUEUED: decision
    123). A promise is this side's own word, whatever the receiver says. Every method runs with
    ``core.lock``. transfer id -> (receiver endpoint, lease)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.table: dict[str, tuple[str, Lease]] = {}

    def promise(
        self, transfer_id: str, endpoint: str, deadline_s: float, limit_s: float | None, started: bool
    ) -> None:
        """The request behind ``transfer_id`` was accepted (its prefill may be queued): renew the
        receiver's lease (state QUEUED) until ``start``, ``forget`` or the limit. Nothing when the
        transfer ``started`` already, is promised or ended."""
        if started or transfer_id in self.table or self.core.tombstones.get(_SEND, transfer_id) is not None:
            return
        if len(self.table) >= self.core.config.max_pending_transfers:
            raise TransferError("too many promised transfers", transfer_id)
        lease = Lease.start(self.core.now(), deadline_s, limit_s)
        lease.next_renew = 0.0  # tell the receiver at once
        self.table[transfer_id] = (endpoint, lease)

    def started(self, transfer_id: str) -> None:
        """The send started: its own lease takes over."""
        self.table.pop(transfer_id, None)

    def forget(self, transfer_id: str, reason: str) -> None:
        """Drop a promise (the request ended before its send started): the receiver is told at once
        and later renewals of it are answered with an Abort."""
        entry = self.table.pop(transfer_id, None)
        if entry is not None:
            self.core.send_abort(entry[0], transfer_id, reason)
            self.core.tombstones.add(_SEND, transfer_id, reason)

    def drop_endpoint(self, endpoint: str) -> None:
        """The receiver at ``endpoint`` is gone: its promises go (nothing to tell it)."""
        for tid in [t for t, (e, _) in self.table.items() if e == endpoint]:
            del self.table[tid]

    def renew(self, now: float) -> None:
        """Renew (state QUEUED) each promise that is due; drop those past their limit (a request that
        never started)."""
        for tid in [t for t, (_, lease) in self.table.items() if lease.limit <= now]:
            del self.table[tid]
        for tid, (endpoint, lease) in self.table.items():
            if lease.due(now):
                msg = Renew(**self.core.header(endpoint, tid), state=PeerState.QUEUED.value, reply=False)
                self.core.send(endpoint, msg)

    def renewed_by(self, msg: Renew) -> bool:
        """True if ``msg`` is about a transfer promised to its sender."""
        entry = self.table.get(msg.transfer_id)
        return entry is not None and entry[0] == msg.src_endpoint
