"""Discovery wire messages: instance -> router heartbeats and deregistrations.

Every message crosses a process, so it is a typed, versioned msgspec ``Struct`` (tagged union
:data:`DiscoveryMessage`). On the ZeroMQ wire a message is two frames:

* frame 0: the msgpack-encoded message;
* frame 1: ``HMAC-SHA256(secret, frame 0)`` when a shared secret is set, else empty.

:func:`encode_frames` / :func:`decode_frames` are the only (de)serializers. Decoding raises
:class:`~kvwire.errors.ProtocolError` for anything malformed or of an unsupported version, and
:class:`~kvwire.errors.AuthenticationError` when the secret is set and the signature is missing or wrong.
This module must not import torch (the router and the vLLM plugin both use it).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence

import msgspec

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.protocol.kv_params import KVCacheLayout, Role, endpoint_error

DISCOVERY_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024  # a heartbeat is a few hundred bytes; anything bigger is garbage


def new_epoch() -> int:
    """A fresh epoch for a process start: nanoseconds since the Unix epoch (later start -> larger)."""
    return time.time_ns()


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Who an instance is; constant for the life of one process."""

    instance_id: str  # stable name of the instance (survives restarts; the epoch changes)
    role: Role
    url: str  # OpenAI API base, "http://host:port"
    model: str  # model name served (what /v1/models reports)
    epoch: int = msgspec.field(default_factory=new_epoch)  # per process start; newer wins
    kv_endpoints: list[str] = msgspec.field(default_factory=list)  # transfer agent, one per rank
    version: str = ""  # software version of the instance (kvwire or the host engine)
    # How the router can tokenize prompts like this instance does, so that its prefix hashes match
    # the instance's KV events: "byte" (built-in presets) or a local Hugging Face model directory;
    # "" = unknown (the router then needs --tokenizer to use KV events).
    tokenizer: str = ""
    # P/D instances: the KV layout a peer must match (tp_size = len(kv_endpoints)); None: unknown.
    kv_layout: KVCacheLayout | None = None
    # The transfer mode the instance was configured with ("push" / "pull", e.g. the seed's
    # send_type); "" = none (it follows the router's per-request mode). A router in the other mode
    # overrides it: shown by /instances, warned about at registration.
    kv_mode: str = ""
    max_model_len: int = 0  # longest prompt + completion the instance accepts; 0 = unknown


class InstanceLoad(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Load an instance reports with each heartbeat."""

    num_running: int = 0
    num_waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    # peer KV endpoint -> the data plane negotiated with it (shm, tcp, nccl, ipc; "none")
    kv_transports: dict[str, str] = msgspec.field(default_factory=dict)


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat", gc=False):
    """Periodic liveness + load report; the first one registers the instance."""

    info: InstanceInfo
    load: InstanceLoad | None = None  # None when the instance could not measure its load
    seq: int = 0  # increases by one per message of one epoch (drops replays / reordering)
    sent_at: float = 0.0  # sender's wall clock, seconds (informational)
    # etcd records: the instance promises its next record within this many seconds (its lease TTL),
    # so a router may take it out of routing when that passes without one; 0 = no promise
    ttl_s: float = 0.0
    v: int = DISCOVERY_VERSION


class Deregister(msgspec.Struct, frozen=True, kw_only=True, tag="deregister", gc=False):
    """Graceful shutdown: remove this (instance id, epoch) from routing at once."""

    instance_id: str
    epoch: int
    seq: int = 0
    sent_at: float = 0.0
    v: int = DISCOVERY_VERSION


class KvEvents(msgspec.Struct, frozen=True, kw_only=True, tag="kv_events"):
    """Prefix-cache changes of one instance since its previous batch (see :mod:`kvwire.protocol.kv_blocks`).

    Hashes are :mod:`kvwire.protocol.kv_blocks` chained block hashes over ``block_size``-token blocks.
    ``cleared``: forget every hash of this instance before applying (a resync after a lost batch).
    """

    instance_id: str
    epoch: int
    block_size: int
    stored: list[int] = msgspec.field(default_factory=list)
    removed: list[int] = msgspec.field(default_factory=list)
    cleared: bool = False
    num_cached_blocks: int = 0  # hashes the instance holds after this batch
    seq: int = 0
    sent_at: float = 0.0
    v: int = DISCOVERY_VERSION


DiscoveryMessage = Heartbeat | Deregister | KvEvents

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DiscoveryMessage)


def sign(payload: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def encode_frames(msg: DiscoveryMessage, secret: bytes | None = None) -> list[bytes]:
    """Serialize ``msg`` into the two ZeroMQ frames (payload, signature-or-empty)."""
    payload = _encoder.encode(msg)
    return [payload, sign(payload, secret) if secret else b""]


def decode_frames(frames: Sequence[bytes], secret: bytes | None = None) -> DiscoveryMessage:
    """Validate and decode frames from :func:`encode_frames`.

    Raises ``ProtocolError`` (malformed, oversized, unknown type, unsupported version) or
    ``AuthenticationError`` (secret set and signature missing/wrong). The signature is checked before
    the payload is parsed, so unsigned garbage costs one HMAC.
    """
    if len(frames) not in (1, 2):
        raise ProtocolError(f"expected 1 or 2 frames, got {len(frames)}")
    payload = bytes(frames[0])
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"discovery message of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    if secret:
        signature = bytes(frames[1]) if len(frames) == 2 else b""
        if not signature:
            raise AuthenticationError("unsigned discovery message (router requires a secret)")
        if not hmac.compare_digest(signature, sign(payload, secret)):
            raise AuthenticationError("bad discovery message signature")
    try:
        msg = _decoder.decode(payload)
    except Exception as exc:  # DecodeError, ValidationError, RecursionError (nesting), MemoryError...
        raise ProtocolError(f"malformed discovery message: {type(exc).__name__}: {exc}") from exc
    if msg.v != DISCOVERY_VERSION:
        raise ProtocolError(f"discovery message version {msg.v} unsupported (expected {DISCOVERY_VERSION})")
    if isinstance(msg, Heartbeat):
        check_info(msg.info)
    if isinstance(msg, KvEvents) and (not msg.instance_id or msg.block_size <= 0):
        raise ProtocolError("kv_events need an instance_id and a block_size > 0")
    return msg


def check_info(info: InstanceInfo) -> None:
    """Raise ``ProtocolError`` for an empty id or model, a URL that is not http(s), or a KV endpoint
    a transfer agent's control plane cannot connect to (the router hands them to the instance's
    peers as ``kv_transfer_params.peer_endpoints``, which those refuse: decision 150)."""
    if not info.instance_id:
        raise ProtocolError("heartbeat with an empty instance_id")
    if not info.url.startswith(("http://", "https://")):
        raise ProtocolError(f"heartbeat url must start with http:// or https://, got {info.url!r}")
    if not info.model:
        raise ProtocolError("heartbeat with an empty model name")
    for endpoint in info.kv_endpoints:
        error = endpoint_error(endpoint)
        if error is not None:
            raise ProtocolError(f"heartbeat kv_endpoints: {error}")
