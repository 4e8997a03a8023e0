"""Per-request connector state kept by the scheduler half (engine thread only)."""

from __future__ import annotations

import dataclasses
import enum
import time

from kvwire.protocol.kv_params import KVTransferParams
from kvwire.transfer.enums import FailReason


class Phase(enum.Enum):
    # P side
    PREFILLING = "prefilling"  # prompt not complete yet: nothing announced to the agent
    SENDING = "sending"  # send announced with the step that completes the prompt
    AWAITING_SEND = "awaiting_send"  # request finished; blocks held until finished_sending
    SENT = "sent"  # every layer acknowledged while the request still runs (no trailer)
    # D side
    WAITING_ALLOC = "waiting_alloc"  # remote tokens promised, blocks not allocated yet
    RECV_QUEUED = "recv_queued"  # blocks allocated; the RecvSpec goes out with the next metadata
    RECEIVING = "receiving"  # the worker expects the transfer
    LOADED = "loaded"  # remote KV is in (or failed and recompute was chosen): decode locally
    ABORTING = "aborting"  # request ended mid-receive: blocks held until the worker cancelled
    # either side
    LOCAL = "local"  # nothing to transfer (no params, or not needed)


@dataclasses.dataclass
class RequestState:
    request_id: str
    params: KVTransferParams
    phase: Phase
    num_prompt_tokens: int
    deadline_s: float
    created_s: float = dataclasses.field(default_factory=time.monotonic)
    transfer_started_s: float | None = None  # P: send announced; D: expect issued
    block_ids: tuple[int, ...] = ()  # P: prompt blocks sent; D: blocks the KV is loaded into
    num_remote_tokens: int = 0  # D: tokens (from position 0) whose KV comes from P
    num_local_tokens: int = 0  # D: leading tokens whose KV D already had (prefix cache)
    first_token_id: int | None = None  # D: P's first token, once the load completed


def reason_label(reason: str) -> str:
    """Bounded metric label for a failure reason: its :class:`FailReason` kind (every reason the
    agent and the connector produce starts with one; anything else is ``other``)."""
    return FailReason.of(reason).value
