"""What the send and receive halves of one agent share: counters, the control-plane messages, bounded
peer tables, leases, and the base of both halves' transfers.

Read in order: the agent's counters; the typed wire messages and their codec; the per-peer bounded
table; liveness leases and the lease clock; the shared core (lock, events, peers, I/O) and
``Transfers``, the table of one side with the one ``fail``.

Counters
--------
Counters of one transfer agent (read with ``agent.stats()``; exported to Prometheus elsewhere).

Control-plane messages
----------------------
Control-plane messages of the transfer agent (typed, versioned msgspec Structs; msgpack on the wire).

Wire format: one ZMQ multipart message per control message, sent DEALER -> the peer's ROUTER:
``[payload]`` or, when a shared secret is configured, ``[payload, hmac_sha256(secret, payload)]``.
``payload`` is a msgpack map tagged by ``t`` with the protocol version ``v``. Anything that does not
decode, has an unknown tag, another version, fails validation or lacks a valid MAC raises
:class:`~kvwire.errors.ProtocolError` (:class:`~kvwire.errors.AuthenticationError` for the MAC); the
agent logs it, counts it and keeps working.

Every message names its sender's epoch (``src_id``, random per process start) and control endpoint
(``src_endpoint``), and the epoch it believes the receiver has (``dst_id``, "" when unknown): a
message for an older epoch of the receiver is stale and answered with an Abort.

Peer tables
-----------
A table of entries that peers create (decision 116): bounded per peer and in all.

What a peer can leave waiting on this side before this side knows the transfer (an early Grant, a
Pull of a transfer not started yet) is kept in a :class:`PeerTable`: at most ``per_peer`` entries per
peer endpoint and ``total`` in all, so one peer (or many spoofed endpoints) cannot grow memory without
bound or crowd the others out. :meth:`PeerTable.admit` names the limit a new entry would break.
Callers hold the agent lock (no locking here).

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
flight each side sends its peer a :class:`~kvwire.transfer.core.Renew` every
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
:class:`~kvwire.transfer.receiver.RecvState`). :class:`Transfers` is the table of one side: it ends a
transfer as failed (:meth:`Transfers.fail`, the one place that does), expires those past their lease,
sends the Renews that are due and checks that a Renew comes from the transfer's peer. A side adds
what only it frees (buffers, slabs, pieces) through the ``_released``/``_after_failure`` hooks.
Every method runs with ``core.lock`` held (decisions 051, 092, 123).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import hashlib
import hmac
import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from kvwire.errors import AuthenticationError, ProtocolError, TransferError
from kvwire.http.refusal_log import RefusalLog
from kvwire.transfer.buffers import RecvMemory
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import FailReason
from kvwire.transfer.memory import DTYPES_BY_NAME, PeerRef, TransferEvents, TransferTiming
from kvwire.transfer.planes.base import DataPlane

if TYPE_CHECKING:
    from kvwire.transfer.agent import ControlLoop


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


class ControlLimit(str, enum.Enum):
    """The control-plane limits a peer can hit (labels of ``limits_hit``; see ControlLimits)."""

    MESSAGE_BYTES = "control_message_bytes"  # a control frame over max_message_bytes (refused)
    FRAMES = "control_frames"  # a control message of more frames than the protocol has (refused)
    PEER_DEADLINE = "peer_deadline"  # an Offer/Pull lease outside our bounds (clamped)
    EARLY_GRANTS = "early_grants"  # an early Grant not kept: max_early_grants reached
    EARLY_GRANTS_PER_PEER = "early_grants_per_peer"  # ... max_early_grants_per_peer reached
    PENDING_PER_PEER = "pending_per_peer"  # an Offer or Pull refused: max_pending_per_peer reached
    PENDING_TRANSFERS = "pending_transfers"  # an Offer refused: max_pending_transfers reached
    PENDING_PULLS = "pending_pulls"  # a Pull refused: max_pending_pulls reached
    PEERS = "peers"  # a peer endpoint's epoch forgotten: max_peers reached
    ENDPOINT = "control_endpoint"  # a message not sent: ZeroMQ refuses its endpoint (dropped, logged)


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


# ============================== Control-plane messages

PROTOCOL_VERSION = 1
MAX_ID_LEN = 512  # transfer ids and instance ids
MAX_MESSAGE_BYTES = 4 << 20  # a control message never carries layer data
MAX_TRAILER_BYTES = 1 << 20
MAC_BYTES = 32
MAX_STATE_LEN = 32
MAX_REASON_LEN = 1024  # a peer's Abort reason, as kept (tombstones, poll events) and logged: clamped
MAX_PIECES = 4096  # pulls one held transfer may serve (a piece per receiving rank)
MAX_FRAMES = 2  # payload [+ MAC]
MAX_LAYER_DIMS = 8  # a layer's shape (a product of thousands of huge numbers would stall the thread)
# What decoding hostile bytes may raise besides msgspec's own errors (deep nesting, huge lengths, ...):
# all of it is a ProtocolError to the caller.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, MemoryError, ValueError,
                  TypeError, OverflowError)


class Msg(msgspec.Struct, tag_field="t", kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION
    src_id: str  # sender's instance id (epoch)
    src_endpoint: str  # sender's control endpoint (replies go there)
    dst_id: str = ""  # receiver's instance id as the sender knows it ("" = unknown)
    transfer_id: str


class WireLayer(msgspec.Struct, array_like=True, frozen=True):
    shape: list[int]
    dtype: str


class Offer(Msg, tag="offer", frozen=True):
    """Sender -> receiver, once per transfer: every layer's shape/dtype (and thus size)."""

    layers: list[WireLayer]
    deadline_s: float  # seconds left (relative: clocks of the two hosts may differ)
    data_address: str  # sender's data plane address
    with_trailer: bool = False
    plane_info: bytes = b""


class Grant(Msg, tag="grant", frozen=True):
    """Receiver -> sender: credit for these layers (destination buffers are posted)."""

    layers: list[int]
    data_address: str  # receiver's data plane address
    plane_info: bytes = b""
    # Sent at the receiver's expect, before the sender's Offer (decision 110): the sender keeps it
    # until it starts the transfer (while the receiver renews it), instead of answering "unknown",
    # and uses it only if its layers have these sizes (bytes, one per granted layer).
    early: bool = False
    sizes: list[int] = msgspec.field(default_factory=list)


class Ack(Msg, tag="ack", frozen=True):
    """Receiver -> sender: these layers (and the trailer) arrived. Coalesced per transfer."""

    layers: list[int]
    trailer: bool = False


class Trailer(Msg, tag="trailer", frozen=True):
    """Sender -> receiver: small bytes delivered with completion (e.g. the first sampled token)."""

    payload: bytes


class Abort(Msg, tag="abort", frozen=True):
    """Either side: the transfer failed or was aborted; the peer frees everything it holds."""

    reason: str


class Pull(Msg, tag="pull", frozen=True):
    """Receiver -> sender (pull mode): send me the transfer you hold.

    A *piece* pull (``held`` set; tensor-parallel split, docs/decisions/087): send me, as transfer
    ``transfer_id``, the KV heads ``heads`` (``[start, stop)`` of your local heads; empty: whole
    layers) of every layer of the transfer you hold as ``held``; you serve ``pieces`` such pulls in
    all. ``pieces == 0`` is a release: nothing of ``held`` is wanted (no reply)."""

    deadline_s: float
    data_address: str
    plane_info: bytes = b""
    held: str = ""
    heads: list[int] = msgspec.field(default_factory=list)
    pieces: int = 0


class Renew(Msg, tag="renew", frozen=True):
    """Either side, periodically while a transfer is in flight: I am alive and this is the
    transfer's state here (a :class:`~kvwire.transfer.core.PeerState` value). Renews the peer's
    lease on the transfer; a Renew that is not a ``reply`` is answered with a reply (or an Abort
    when this side's transfer failed)."""

    state: str
    reply: bool = False


AnyMsg = Offer | Grant | Ack | Trailer | Abort | Pull | Renew


class _Head(msgspec.Struct):
    t: str = ""
    v: int = -1


class Codec:
    """Encodes/decodes control messages, with an HMAC per message when a secret is set."""

    def __init__(self, secret: bytes | None, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        """``max_message_bytes``: the largest payload accepted (``ControlLimits.max_message_bytes``)."""
        self._secret = secret
        self._max_bytes = max_message_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._head = msgspec.msgpack.Decoder(_Head)
        self._decoder = msgspec.msgpack.Decoder(AnyMsg)

    def encode(self, msg: AnyMsg) -> list[bytes]:
        payload = self._encoder.encode(msg)
        if self._secret is None:
            return [payload]
        return [payload, hmac.new(self._secret, payload, hashlib.sha256).digest()]

    def decode(self, frames: Sequence[bytes]) -> AnyMsg:
        """Decode and validate one message; raises ProtocolError / AuthenticationError, and nothing
        else whatever the bytes (sizes are checked before the MAC is computed or anything decoded)."""
        if not frames or len(frames) > MAX_FRAMES:
            raise ProtocolError(f"expected 1 or {MAX_FRAMES} frames, got {len(frames)}")
        payload = frames[0]
        if len(payload) > self._max_bytes:
            raise ProtocolError(f"control message of {len(payload)} bytes exceeds {self._max_bytes}")
        if self._secret is not None:
            mac = frames[1] if len(frames) == 2 else b""
            if len(mac) != MAC_BYTES:
                raise AuthenticationError("control message without a valid HMAC")
            good = hmac.new(self._secret, payload, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, good):
                raise AuthenticationError("control message without a valid HMAC")
        try:
            head = self._head.decode(payload)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"malformed control message: {type(exc).__name__}: {exc}") from exc
        if head.v != PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {head.v} (type {head.t[:MAX_STATE_LEN]!r})")
        try:
            msg: AnyMsg = self._decoder.decode(payload)
        except _DECODE_ERRORS as exc:
            kind = head.t[:MAX_STATE_LEN]
            raise ProtocolError(f"invalid {kind!r} message: {type(exc).__name__}: {exc}") from exc
        validate(msg)
        if isinstance(msg, Abort) and len(msg.reason) > MAX_REASON_LEN:
            msg = msgspec.structs.replace(msg, reason=msg.reason[:MAX_REASON_LEN] + "...")
        return msg


def _check_id(name: str, value: str, allow_empty: bool = False) -> None:
    if (not value and not allow_empty) or len(value) > MAX_ID_LEN:
        raise ProtocolError(f"{name} must be 1..{MAX_ID_LEN} characters")


# What a peer may name as its control endpoint (replies are sent there: ZeroMQ connects to it, and
# refuses a malformed one with an error only at connect time): tcp://host:port, ipc://path, inproc://name.
_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}|(?:ipc|inproc)://[^\x00\s]+")


def _check_endpoint(endpoint: str) -> None:
    if len(endpoint) > MAX_ID_LEN or not _ENDPOINT.fullmatch(endpoint):
        raise ProtocolError(f"src_endpoint {endpoint[:80]!r} is not a ZMQ endpoint")
    if endpoint.startswith("tcp://") and not 0 < int(endpoint.rsplit(":", 1)[1]) < 65536:
        raise ProtocolError(f"src_endpoint {endpoint[:80]!r} has no valid port")


def validate(msg: AnyMsg) -> None:
    """Semantic checks msgspec types cannot express (bounds, known dtypes, non-negative sizes)."""
    _check_id("transfer_id", msg.transfer_id)
    _check_id("src_id", msg.src_id)
    _check_id("dst_id", msg.dst_id, allow_empty=True)
    _check_endpoint(msg.src_endpoint)
    if isinstance(msg, Offer):
        for layer in msg.layers:
            bad_shape = len(layer.shape) > MAX_LAYER_DIMS or any(d < 0 for d in layer.shape)
            if layer.dtype not in DTYPES_BY_NAME or bad_shape:
                dtype = layer.dtype[:MAX_STATE_LEN]
                dims = len(layer.shape)
                raise ProtocolError(f"offer {msg.transfer_id}: bad layer ({dtype!r}, {dims} dims)")
    if isinstance(msg, (Offer, Pull)) and not (math.isfinite(msg.deadline_s) and msg.deadline_s > 0):
        raise ProtocolError(f"{type(msg).__name__} {msg.transfer_id}: deadline_s must be finite and > 0, "
                            f"got {msg.deadline_s}")
    if isinstance(msg, Pull) and msg.held:
        _check_id("held", msg.held)
        bad_heads = msg.heads and (len(msg.heads) != 2 or not 0 <= msg.heads[0] < msg.heads[1])
        if bad_heads or not 0 <= msg.pieces <= MAX_PIECES:
            raise ProtocolError(f"pull {msg.transfer_id}: bad piece (heads {msg.heads}, pieces {msg.pieces})")
    if isinstance(msg, (Grant, Ack)) and any(i < 0 for i in msg.layers):
        raise ProtocolError(f"{type(msg).__name__} {msg.transfer_id}: negative layer index")
    if isinstance(msg, Renew) and len(msg.state) > MAX_STATE_LEN:
        raise ProtocolError(f"renew {msg.transfer_id}: state is too long")
    if isinstance(msg, Trailer) and len(msg.payload) > MAX_TRAILER_BYTES:
        raise ProtocolError(f"trailer of {msg.transfer_id} exceeds {MAX_TRAILER_BYTES} bytes")


# ============================== Peer tables

K = TypeVar("K")
V = TypeVar("V")


class PeerTable(Generic[K, V]):
    """``key -> value``, each entry owned by the peer endpoint that created it."""

    def __init__(
        self, per_peer: int, total: int, per_peer_limit: ControlLimit, total_limit: ControlLimit
    ) -> None:
        self._per_peer = per_peer
        self._total = total
        self._limits = (per_peer_limit, total_limit)
        self._items: dict[K, tuple[str, V]] = {}
        self._counts: collections.Counter[str] = collections.Counter()

    def admit(self, key: K, peer: str) -> ControlLimit | None:
        """None when ``peer`` may put ``key`` now (a key it already holds always may), else the limit
        it would break."""
        held = self._items.get(key)
        if held is not None and held[0] == peer:
            return None
        if self._counts[peer] >= self._per_peer:
            return self._limits[0]
        if len(self._items) >= self._total:
            return self._limits[1]
        return None

    def put(self, key: K, peer: str, value: V) -> None:
        """Store (after :meth:`admit` said yes); replaces ``key``'s entry."""
        self.pop(key)
        self._items[key] = (peer, value)
        self._counts[peer] += 1

    def pop(self, key: K) -> V | None:
        held = self._items.pop(key, None)
        if held is None:
            return None
        peer = held[0]
        self._counts[peer] -= 1
        if self._counts[peer] <= 0:
            del self._counts[peer]
        return held[1]

    def get(self, key: K) -> V | None:
        held = self._items.get(key)
        return None if held is None else held[1]

    def peer_of(self, key: K) -> str | None:
        held = self._items.get(key)
        return None if held is None else held[0]

    def items(self) -> Iterator[tuple[K, V]]:
        """A snapshot: the table may change while the caller iterates."""
        return iter([(key, value) for key, (_, value) in self._items.items()])

    def count(self, peer: str) -> int:
        return self._counts[peer]

    def clear(self) -> None:
        self._items.clear()
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


# ============================== Leases

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


# ============================== The shared core and the transfer table

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
        """Queue ``msg`` for the control thread and wake it (any thread): the loop's outbox and waker
        are used here directly, so that sending is no call back into the agent's module (decision 143)."""
        control = self.control
        assert control is not None
        control.outbox.append((endpoint, msg))
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
