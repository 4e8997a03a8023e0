"""Per-step metadata from the scheduler half to the worker halves (picklable: vLLM ships it to workers).

Every item names the request and its router-minted transfer id. Workers apply, in order: promises,
aborts, receives, sends, trailers (``KvwireWorkerConnector.bind_connector_metadata``).
"""

from __future__ import annotations

import dataclasses

from kvwire.connector.base import ConnectorMetadata
from kvwire.connector.first_token_trailer import FirstTokenTrailer


@dataclasses.dataclass(frozen=True)
class SendSpec:
    """P: announce a transfer now and hand each KV layer of ``block_ids`` to the agent during this
    step's forward (this step computes the last prompt token)."""

    request_id: str
    transfer_id: str
    peer_endpoints: tuple[str, ...]  # D's endpoints, one per rank; empty = pull (held under a lease)
    block_ids: tuple[int, ...]  # the prompt's blocks to send, in token order (partial: after D's prefix)
    deadline_s: float
    with_trailer: bool  # the first token follows in a TrailerSpec
    # Pull mode: D's endpoints, one per rank, the only agents that may pull this transfer (the pair
    # the router named). Empty: the first puller gets the lease.
    pull_by: tuple[str, ...] = ()
    limit_s: float | None = None  # overall bound on the renewed lease (None: the agent's default)


@dataclasses.dataclass(frozen=True)
class RecvSpec:
    """D: expect a transfer and scatter each arriving layer into ``block_ids``."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]  # D's blocks for the loaded tokens, in token order
    deadline_s: float
    pull_from: tuple[str, ...]  # P's endpoints (pull mode); empty in push mode
    want_trailer: bool  # push with first token: read the trailer on completion
    # Leading blocks D already holds (local prefix-cache hit, possibly shared with running
    # requests): their arriving copies are not written.
    skip_blocks: int = 0
    # P's endpoints, one per rank, that the router named (push): the only agents whose offer of this
    # transfer is accepted, and the ones D renews its lease with before P's Offer arrives. Empty: the
    # first offer wins.
    sender_endpoints: tuple[str, ...] = ()
    # Partial transfer: P's payload starts at this block of ``block_ids`` (P does not send the
    # blocks before it; D holds them). ``first_block <= skip_blocks``.
    first_block: int = 0
    # P's tensor-parallel size (push: how many endpoints P has); 0 = the same as D's.
    peer_tp_size: int = 0
    limit_s: float | None = None  # overall bound on the renewed lease (None: the agent's default)


@dataclasses.dataclass(frozen=True)
class PromiseSpec:
    """P: this transfer's request was accepted (its prefill may be queued); the agent renews D's
    lease on it until the send starts (decision 051)."""

    transfer_id: str
    peer_endpoints: tuple[str, ...]  # D's endpoints, one per rank
    deadline_s: float
    limit_s: float | None = None


@dataclasses.dataclass(frozen=True)
class TrailerSpec:
    """P: the small payload (first sampled token) delivered with the transfer's completion."""

    request_id: str
    transfer_id: str
    first_token: FirstTokenTrailer


@dataclasses.dataclass(frozen=True)
class AbortSpec:
    """Either side: cancel the transfer. ``report_free``: report ``request_id`` in
    ``finished_sending`` once cancelled (the engine is holding its blocks until then). An empty
    ``request_id``: an admission withdrawn (``RequestHooks.withdraw_request_params``), whose engine
    id is not known; a send of it that this rank started is reported by its own request id."""

    request_id: str
    transfer_id: str
    reason: str
    report_free: bool


@dataclasses.dataclass(frozen=True)
class KvwireConnectorMetadata(ConnectorMetadata):
    sends: tuple[SendSpec, ...] = ()
    recvs: tuple[RecvSpec, ...] = ()
    trailers: tuple[TrailerSpec, ...] = ()
    aborts: tuple[AbortSpec, ...] = ()
    promises: tuple[PromiseSpec, ...] = ()

    def is_empty(self) -> bool:
        return not (self.sends or self.recvs or self.trailers or self.aborts or self.promises)
