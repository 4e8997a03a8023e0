"""Bounds and liveness of the data-plane links (TCP, shared memory, CUDA IPC): frozen, validated once.

Built at the edge (``kvwire serve`` flags, the vLLM plugin's extra config) and passed down inside
:class:`~kvwire.transfer.config.TransferConfig` (``links``). Every data-plane listener is a trust
boundary: a connection is accepted before its peer proved anything, so what an unauthenticated peer
can hold (connections, the thread each one gets, the time its hello may take) is capped here, and an
authenticated link that stops moving bytes is cut (docs/decisions/115-data-link-bounds.md).

No torch here: the vLLM plugin's config mapping imports this module.
"""

from __future__ import annotations

import dataclasses
import math

from kvwire.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataLinkConfig:
    """Caps and deadlines of every data-plane link and listener."""

    # Connections one listener holds at once (handshaking or authenticated); beyond it a new one is
    # closed at once (``kvwire_limit_hits_total{limit="data_listener_full"}``). Each costs a thread.
    max_connections: int = 256
    # ... of them from one peer address (TCP: the remote IP; same-host planes: the peer process); above
    # max_connections it is that cap that holds.
    max_connections_per_peer: int = 32
    # A connection that has not completed its hello (nonce, MAC; the shared-memory setup) this long
    # after it was accepted is closed, however slowly it trickles bytes.
    handshake_timeout_s: float = 5.0
    # An idle link says it is alive this often (TCP: a heartbeat frame each way; also the kernel's
    # TCP_KEEPIDLE and TCP_KEEPINTVL).
    keepalive_s: float = 2.0
    # A link that moves nothing for this long is dead: a write that makes no progress (the peer stops
    # reading), a shared-memory ring that gets no credit back, a TCP link that hears neither data nor
    # heartbeat (the peer's host vanished, or a partition). Its transfers fail ``peer_lost``; its
    # thread and socket are freed. Also TCP_USER_TIMEOUT, and TCP_KEEPCNT = this / ``keepalive_s``.
    link_timeout_s: float = 15.0
    # One-copy destinations (shm, CUDA IPC) a sender keeps from one peer epoch's grants, and from all:
    # a peer names them for any transfer id, and they leave only when sent, cancelled or the peer is
    # dropped. Over a cap one is not kept (``data_granted_dests_full``): shm writes that layer through
    # the ring, IPC fails it.
    max_granted_dests_per_peer: int = 65536
    max_granted_dests: int = 262144

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_connections_per_peer < 1:
            raise ConfigError("DataLinkConfig: max_connections and max_connections_per_peer must be >= 1")
        if self.max_granted_dests_per_peer < 1 or self.max_granted_dests < 1:  # per peer > total: total holds
            raise ConfigError("DataLinkConfig: max_granted_dests_per_peer and max_granted_dests must be >= 1")
        for name in ("handshake_timeout_s", "keepalive_s", "link_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"DataLinkConfig.{name} must be a finite number > 0, got {value!r}")
        if self.link_timeout_s < 2 * self.keepalive_s:
            raise ConfigError(
                f"DataLinkConfig.link_timeout_s ({self.link_timeout_s}) must be at least twice "
                f"keepalive_s ({self.keepalive_s}): a link must miss two heartbeats before it is cut"
            )

    @property
    def keepalive_probes(self) -> int:
        """TCP_KEEPCNT: unanswered kernel probes before the connection is dropped."""
        return max(1, math.ceil(self.link_timeout_s / self.keepalive_s))
