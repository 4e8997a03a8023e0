"""The control plane's wire: the typed messages two agents exchange, their codec, and the bounds on
what a peer may leave waiting on this side.

Read in order: the limits a peer can hit; the messages and their codec; the per-peer bounded table.
Nothing here keeps state of a transfer: the sides (``kvwire.transfer.core``, ``kvwire.transfer.sender``)
build the messages, the control thread (``kvwire.transfer.agent``) encodes and decodes them.

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
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import math
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import msgspec

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.protocol.kv_params import endpoint_error
from kvwire.transfer.memory import DTYPES_BY_NAME

# ============================== Limits a peer can hit

class ControlLimit(str, enum.Enum):
    """The control-plane limits a peer can hit (labels of ``limits_hit``; see ControlLimits)."""

    MESSAGE_BYTES = "control_message_bytes"  # a control frame over max_message_bytes (refused)
    FRAMES = "control_frames"  # a control message of more frames than the protocol has (refused)
    PEER_DEADLINE = "peer_deadline"  # an Offer/Pull lease outside our bounds (clamped)
    EARLY_GRANTS = "early_grants"  # an early Grant not kept: max_early_grants reached
    EARLY_GRANTS_PER_PEER = "early_grants_per_peer"  # ... max_early_grants_per_peer reached
    PENDING_PER_PEER = "pending_per_peer"  # an Offer or Pull refused: max_pending_per_peer reached
    # an Offer not expected yet left waiting for expect(): max_unexpected_bytes_per_peer granted already
    UNEXPECTED_BYTES_PER_PEER = "unexpected_bytes_per_peer"
    # an Offer expect() had not named max_unsolicited_wait_s after its arrival: failed, its sender told
    UNSOLICITED_WAIT = "unsolicited_wait"
    PENDING_TRANSFERS = "pending_transfers"  # an Offer refused: max_pending_transfers reached
    PENDING_PULLS = "pending_pulls"  # a Pull refused: max_pending_pulls reached
    PEERS = "peers"  # a peer endpoint's epoch forgotten: max_peers reached
    ENDPOINT = "control_endpoint"  # a message not sent: ZeroMQ refuses its endpoint (dropped, logged)


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
    # The sender holds the receiver's early grant of this transfer and sends under it (decision
    # 165): the receiver need not send it again as an ordinary grant.
    early_grant_used: bool = False


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


def _check_endpoint(endpoint: str) -> None:
    """A peer's control endpoint (replies are sent there: ZeroMQ connects to it, and refuses a
    malformed one with an error only at connect time; see ``kv_params.endpoint_error``)."""
    error = endpoint_error(endpoint)
    if error is not None:
        raise ProtocolError(f"src_endpoint {error}")


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
