"""The router's discovery backend, chosen by :attr:`RouterConfig.discovery`.

* :class:`ZmqDiscovery` (default, embedded): the ZeroMQ heartbeat listener + the TTL sweeper.
* :class:`~kvwire.router.etcd_watcher.EtcdWatcher`: range + watch on an etcd prefix; any number of
  routers watching one prefix see the same instances.

Both feed the same :class:`~kvwire.router.registry.Registry`; the rest of the router (selection,
dispatch, ``/instances``, metrics) does not know which one runs.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol

from kvwire.discovery.address import DiscoveryKind
from kvwire.router.config import RouterConfig
from kvwire.router.etcd_watcher import EtcdWatcher
from kvwire.router.listener import DiscoveryListener
from kvwire.router.registry import KvIndex, Registry
from kvwire.router.sweeper import RegistrySweeper
from kvwire.supervision import HealthBoard

# instance epochs whose last seq the freshness check remembers, per instance the registry may hold
# (restarts within the window each add one)
FRESHNESS_PER_INSTANCE = 10


class RouterDiscovery(Protocol):
    kind: DiscoveryKind
    received: collections.Counter[str]  # discovery updates applied, by ApplyResult value
    dropped: collections.Counter[str]  # discarded updates, by reason

    @property
    def connections_dropped(self) -> int:
        """Discovery connections closed before one valid message (ZeroMQ; 0 for etcd)."""
        ...

    @property
    def address(self) -> str: ...

    @property
    def stale(self) -> bool:
        """True while the registry is not backed by a live discovery source (etcd unreachable)."""
        ...

    @property
    def last_error(self) -> str:
        """Why the view is stale ("" when it is not): etcd unreachable, credentials refused."""
        ...

    @property
    def freshness_evicted(self) -> int:
        """Instance epochs whose last ``seq`` was forgotten early (the freshness memory was full)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ZmqDiscovery:
    """Embedded discovery: the heartbeat socket (bound at construction) and the TTL sweeper."""

    kind = DiscoveryKind.ZMQ
    stale = False  # the router itself is the source of truth
    last_error = ""

    def __init__(
        self, registry: Registry, cfg: RouterConfig, kv_index: KvIndex | None = None, *,
        board: HealthBoard | None = None,
    ) -> None:
        self.listener = DiscoveryListener(
            registry, cfg.discovery_host, cfg.discovery_port, cfg.secret_bytes, kv_index=kv_index,
            board=board, freshness_window_s=cfg.discovery_freshness_s,
            freshness_max_entries=FRESHNESS_PER_INSTANCE * cfg.max_instances,
        )
        self.sweeper = RegistrySweeper(registry, cfg.sweep_interval_s, board=board)
        self.received = self.listener.received
        self.dropped = self.listener.dropped

    @property
    def address(self) -> str:
        return self.listener.address

    @property
    def connections_dropped(self) -> int:
        return self.listener.connections_dropped

    @property
    def freshness_evicted(self) -> int:
        return 0 if self.listener.freshness is None else self.listener.freshness.evicted

    async def start(self) -> None:
        self.listener.start()
        self.sweeper.start()

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._stop_threads)

    def _stop_threads(self) -> None:
        self.sweeper.close()
        self.listener.close()


class EtcdDiscovery(EtcdWatcher):
    kind = DiscoveryKind.ETCD
    connections_dropped = 0  # the watch is the router's own connection

    @property
    def freshness_evicted(self) -> int:
        return 0 if self.freshness is None else self.freshness.evicted


def make_discovery(
    cfg: RouterConfig, registry: Registry, kv_index: KvIndex | None = None, *,
    board: HealthBoard | None = None,
) -> ZmqDiscovery | EtcdDiscovery:
    """The backend ``cfg`` names. KV events (``kv_index``) arrive on the ZeroMQ connection only.
    Its threads and tasks are supervised on ``board`` (the router's /health)."""
    target = cfg.discovery_target
    if target is None:
        return ZmqDiscovery(registry, cfg, kv_index, board=board)
    return EtcdDiscovery(registry, target, board=board, secret=cfg.secret_bytes,
                         freshness_window_s=cfg.discovery_freshness_s,
                         freshness_max_entries=FRESHNESS_PER_INSTANCE * cfg.max_instances)
