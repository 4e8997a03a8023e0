"""Registration with the router: heartbeats carrying this instance's role, URL, KV endpoints and load.

The discovery client is imported lazily, so a server started without ``--router`` needs none of it.
The heartbeat thread calls ``load_fn``, which only reads the engine loop's latest immutable
:class:`~kvwire.server.engine_loop.StatsSnapshot` (never the engine itself).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import kvwire
from kvwire.server.config import ServerConfig
from kvwire.server.engine_loop import StatsSnapshot

if TYPE_CHECKING:
    from kvwire.discovery import Registration
    from kvwire.protocol.kv_blocks import KvEventLog
    from kvwire.supervision import HealthBoard


def default_instance_id(config: ServerConfig) -> str:
    return config.instance_id or f"{config.role.value}-{uuid.uuid4().hex[:8]}"


def start_heartbeats(
    config: ServerConfig,
    *,
    instance_id: str,
    url: str,
    model: str,
    kv_endpoints: Sequence[str],
    stats_fn: Callable[[], StatsSnapshot],
    secret: str | None = None,
    kv_events: KvEventLog | None = None,
    tokenizer: str = "",
    kv_layout: Any = None,
    transports_fn: Callable[[], dict[str, str]] | None = None,
    board: HealthBoard | None = None,
    max_model_len: int = 0,
) -> Registration | None:
    """Start heartbeating to ``config.router_address``; returns the client (call ``close()`` to
    deregister) or None when no router is configured. ``kv_events``: the engine's prefix-cache log,
    published to the router as KV events; ``tokenizer``: ``InstanceInfo.tokenizer``;
    ``transports_fn``: peer KV endpoint -> data plane negotiated with it (reported in each
    heartbeat's load, shown by the router's /instances); ``board``: the instance's health board (the
    registration thread is supervised there)."""
    if config.router_address is None:
        return None
    from kvwire.discovery import InstanceLoad, start_registration

    def load() -> InstanceLoad:
        stats = stats_fn()
        return InstanceLoad(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting + stats.num_waiting_for_remote_kv,
            free_kv_blocks=max(0, stats.kv_blocks_total - stats.kv_blocks_in_use),
            total_kv_blocks=stats.kv_blocks_total,
            kv_transports=transports_fn() if transports_fn is not None else {},
        )

    return start_registration(
        config.router_address, instance_id=instance_id, role=config.role, url=url, model=model,
        kv_endpoints=kv_endpoints, version=f"kvwire {kvwire.__version__}", load_fn=load,
        interval_s=config.heartbeat_interval_s, secret=secret, kv_events=kv_events, tokenizer=tokenizer,
        kv_layout=kv_layout, board=board, max_model_len=max_model_len,
    )
