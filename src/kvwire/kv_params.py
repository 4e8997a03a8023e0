"""``kv_transfer_params``: the routing data the router gives prefill (P) and decode (D) instances.

This is the one typed definition of the fields agreed between the router and the connector. On the
HTTP wire they travel as a JSON object in the request body field ``kv_transfer_params`` (the same
field vLLM passes to its KV connectors); inside kvwire they are always a :class:`KVTransferParams`.

Push mode (default): the router mints ``transfer_id`` and sends P and D their requests concurrently.
  P gets ``role=PREFILL`` and D's KV endpoints in ``peer_endpoints``; D gets ``role=DECODE`` and P's.
Pull mode: the router calls P first (``role=PREFILL``, no peer); P answers with params of its own
  (``peer_endpoints`` = P's endpoints, ``first_token_id``, ``num_prompt_tokens``) that the router
  forwards to D with ``role=DECODE``.

Routing data lives in these explicit fields, never inside request-id strings.
"""

from __future__ import annotations

import enum
from typing import Any

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


class PDRole(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    mode: TransferMode = TransferMode.PUSH
    role: PDRole
    # The other side's transfer-agent endpoints, one per worker rank (rank r talks to rank r).
    # Empty for P in pull mode (D comes to P).
    peer_endpoints: list[str] = msgspec.field(default_factory=list)
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
    v: int = KV_PARAMS_VERSION

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
        if params.deadline_s <= 0:
            raise InvalidRequestError("kv_transfer_params.deadline_s must be > 0")
        if params.limit_s is not None and params.limit_s <= 0:
            raise InvalidRequestError("kv_transfer_params.limit_s must be > 0")
        return params
