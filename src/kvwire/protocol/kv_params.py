"""``kv_transfer_params``: the routing data the router gives prefill (P) and decode (D) instances.

This is the one typed definition of the fields agreed between the router and the connector. On the
HTTP wire they travel as a JSON object in the request body field ``kv_transfer_params`` (the same
field vLLM passes to its KV connectors); inside kvwire they are always a :class:`KVTransferParams`.

Push mode (default): the router mints ``transfer_id`` and sends P and D their requests concurrently.
  P gets ``role=PREFILL`` and D's KV endpoints in ``peer_endpoints``; D gets ``role=DECODE`` and P's.
Pull mode: the router calls P first (``role=PREFILL``, ``peer_endpoints`` = the D it picked, the
  only agents allowed to pull; empty = the first puller); P answers with params of its own
  (``peer_endpoints`` = P's endpoints, ``first_token_id``, ``num_prompt_tokens``) that the router
  forwards to D with ``role=DECODE``.

Routing data lives in these explicit fields, never inside request-id strings.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec

from kvwire.errors import InvalidRequestError

KV_PARAMS_VERSION = 1


class LoadFailurePolicy(str, enum.Enum):
    """What D does when remote KV cannot be loaded (deadline, peer lost, aborted by P). Defined here,
    next to the other torch-free P/D vocabulary, so `kvwire up` and the router need no torch; the
    connector, engine and server configs use this one enum."""

    RECOMPUTE = "recompute"  # prefill the prompt locally (counted in metrics)
    FAIL = "fail"  # end the request with a clear error


class TransferMode(str, enum.Enum):
    PUSH = "push"  # P pushes each KV layer to D as soon as it is computed (the reference's PUT)
    PULL = "pull"  # P keeps the blocks under a lease; D pulls them (the reference's GET)


class Role(str, enum.Enum):
    """What an instance (or one side of a transfer) does in P/D: the one role vocabulary of the
    package — instances, servers, connectors, discovery and ``kv_transfer_params`` share it. A
    transfer side is PREFILL or DECODE; an instance may also be BOTH (colocated, no KV transfer; its
    connector accepts either side per request)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class KVCacheLayout(msgspec.Struct, frozen=True, kw_only=True):
    """What must agree between a P and a D instance for P's KV to be usable on D (decision 057).

    Advertised by each instance (discovery ``InstanceInfo.kv_layout``) and handed by the router to
    the other side of a pair (``KVTransferParams.peer_kv_layout``), which refuses an incompatible
    pair at admission with a clear error instead of loading garbage. ``num_kv_heads`` counts the
    model's KV heads over all ranks (0: no head dimension, MLA); ``tp_size`` may differ between
    P and D as long as each divides, or is a multiple of, ``num_kv_heads``."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tp_size: int = 1


def layout_mismatch(mine: KVCacheLayout, peer: KVCacheLayout) -> str | None:
    """Why ``peer``'s KV cannot be exchanged with ``mine`` (None when it can)."""
    for field in ("model", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"):
        a, b = getattr(mine, field), getattr(peer, field)
        if a != b:
            return f"KV layouts differ: {field} is {a!r} here and {b!r} on the peer"
    heads = mine.num_kv_heads
    for who, tp in (("this instance's", mine.tp_size), ("the peer's", peer.tp_size)):
        if tp < 1 or (heads and heads % tp and tp % heads):
            return f"{who} tensor-parallel size {tp} neither divides nor is a multiple of {heads} KV heads"
    return None


# What a transfer agent's control plane can connect to (its ZeroMQ DEALER): tcp://host:port (a name,
# an IPv4 address or a bracketed IPv6 one; port 1..65535), ipc://path or inproc://name. ZeroMQ refuses
# anything else only when it connects, which on the control thread costs the message (decision 149).
# The control codec checks every peer's src_endpoint with it, an instance's HTTP edge the
# peer_endpoints of a request, the router an instance's registered kv_endpoints (decision 150).
MAX_ENDPOINT_LEN = 512
# One endpoint per worker rank of the peer: far more than any tensor-parallel size, and a bound on what
# a request's params make the HTTP edge check (each entry) and the connector hold.
MAX_PEER_ENDPOINTS = 1024
_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}|(?:ipc|inproc)://[^\x00\s]+")


def endpoint_error(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a control endpoint (None when it is)."""
    if len(endpoint) > MAX_ENDPOINT_LEN or not _ENDPOINT.fullmatch(endpoint):
        return f"{endpoint[:80]!r} is not a ZMQ endpoint (tcp://host:port, ipc://path or inproc://name)"
    if endpoint.startswith("tcp://") and not 0 < int(endpoint.rsplit(":", 1)[1]) < 65536:
        return f"{endpoint[:80]!r} has no valid port"
    return None


def check_peer_endpoints(endpoints: Sequence[str]) -> None:
    """Raise :class:`InvalidRequestError` naming the first of ``endpoints`` (a request's
    ``kv_transfer_params.peer_endpoints``) that is not a control endpoint. Not part of
    :meth:`KVTransferParams.from_dict`: tests' fake connectors name ``fake://`` endpoints."""
    for index, endpoint in enumerate(endpoints):
        error = endpoint_error(endpoint)
        if error is not None:
            raise InvalidRequestError(f"kv_transfer_params.peer_endpoints[{index}]: {error}")


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    mode: TransferMode = TransferMode.PUSH
    role: Role
    # The other side's transfer-agent endpoints, one per worker rank (their count is the peer's TP
    # size; which rank talks to which: connector/pieces.py).
    # P in pull mode: the D that may pull (empty: the first puller).
    peer_endpoints: Annotated[list[str], msgspec.Meta(max_length=MAX_PEER_ENDPOINTS)] = msgspec.field(
        default_factory=list
    )
    # The other side's instance id (for logs/metrics and epoch checks); optional.
    peer_instance_id: str | None = None
    # Seconds the transfer (push) or the lease on P's blocks (pull) may take before it fails.
    deadline_s: float = 30.0
    # Overall bound (seconds) on the transfer while its peer keeps renewing the lease above
    # (decision 051); None: the instance's default.
    limit_s: float | None = None
    # Pull mode, P -> router -> D: the token P sampled and the prompt length P computed KV for.
    first_token_id: int | None = None
    num_prompt_tokens: int | None = None
    # Push mode, partial transfer (KV-aware routing): D holds the prompt's first ``skip_blocks`` KV
    # blocks in its prefix cache, so P sends only the blocks after them and D writes P's payload from
    # that block on. D checks on admission that it still holds them (else it prefills locally).
    skip_blocks: int = 0
    # The other side's KV layout (the router copies it from discovery): checked at admission.
    peer_kv_layout: KVCacheLayout | None = None
    v: int = KV_PARAMS_VERSION
    # Set by a router with a shared secret (kvwire.protocol.kv_signing): Unix time after which instances
    # refuse these params, and the HMAC over every other field. None = unsigned.
    expires_at: float | None = None
    sig: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict for the ``kv_transfer_params`` request/response field."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def from_dict(cls, data: object) -> KVTransferParams:
        """Validate a ``kv_transfer_params`` JSON object; raises :class:`InvalidRequestError`."""
        if not isinstance(data, dict):
            raise InvalidRequestError("kv_transfer_params must be a JSON object")
        try:
            params = msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"invalid kv_transfer_params: {exc}") from exc
        if params.v != KV_PARAMS_VERSION:
            raise InvalidRequestError(
                f"kv_transfer_params version {params.v} is not supported (expected {KV_PARAMS_VERSION})"
            )
        if not params.transfer_id:
            raise InvalidRequestError("kv_transfer_params.transfer_id must not be empty")
        if params.role is Role.BOTH:
            raise InvalidRequestError("kv_transfer_params.role must be 'prefill' or 'decode'")
        if params.deadline_s <= 0:
            raise InvalidRequestError("kv_transfer_params.deadline_s must be > 0")
        if params.skip_blocks < 0:
            raise InvalidRequestError("kv_transfer_params.skip_blocks must be >= 0")
        if params.limit_s is not None and params.limit_s <= 0:
            raise InvalidRequestError("kv_transfer_params.limit_s must be > 0")
        return params

    @classmethod
    def parse(cls, data: KVParams) -> KVTransferParams:
        """``data`` as typed params: parsed already (the server's edge did it) or a JSON object (an
        engine API given a dict, vLLM's scheduler); raises :class:`InvalidRequestError`."""
        return data if isinstance(data, KVTransferParams) else cls.from_dict(data)


# What an engine's request may carry: typed params (parsed once at the server's edge) or the raw
# JSON object (vLLM hands its connector dicts; the offline API takes either).
KVParams = KVTransferParams | dict[str, Any]


def endpoints_checked(
    check: Callable[[KVTransferParams], object] | None = None,
) -> Callable[[object], KVTransferParams]:
    """An instance's admission check of ``kv_transfer_params``: parse them, refuse a malformed
    ``peer_endpoints`` entry (:func:`check_peer_endpoints`), then run ``check`` (the connector's,
    which may act on them: P promises D its transfer). A server with a shared secret runs the
    router-signature check before all of it (``kv_signing.verifying``): a forged request is a 403
    whatever its endpoints say."""

    def checked(raw: object) -> KVTransferParams:
        params = raw if isinstance(raw, KVTransferParams) else KVTransferParams.from_dict(raw)
        check_peer_endpoints(params.peer_endpoints)
        if check is None:
            return params
        result = check(params)
        return result if isinstance(result, KVTransferParams) else params

    return checked
