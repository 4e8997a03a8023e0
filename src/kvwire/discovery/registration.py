"""Registering an instance with the router: its :class:`InstanceInfo` and a running heartbeat thread.

Shared by every host that announces itself (``kvwire serve`` through
:mod:`kvwire.server.registration`, the vLLM plugin's scheduler half), so they all announce the same
way; each keeps only its own ``load_fn``. No torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvwire.discovery.client import HeartbeatClient, LoadFn
from kvwire.discovery.messages import InstanceInfo, InstanceRole
from kvwire.enum_values import as_enum

logger = logging.getLogger(__name__)


def start_registration(
    router_address: str,
    *,
    instance_id: str,
    role: InstanceRole | str,
    url: str,
    model: str,
    kv_endpoints: Sequence[str],
    version: str,
    load_fn: LoadFn | None,
    interval_s: float,
    secret: str | bytes | None = None,
    wait_for_http: bool = False,
) -> HeartbeatClient:
    """Start heartbeating to ``router_address`` and return the client (``close()`` deregisters).

    ``role`` is an :class:`InstanceRole` or its value (``prefill``, ``decode`` or ``both``): the
    server's and the connector's role enums share those values. ``load_fn`` runs on the heartbeat
    thread. Raises :class:`~kvwire.errors.ConfigError` for a malformed address or interval or an
    unknown role; nothing is started then. ``wait_for_http``: send the first heartbeat only once
    an HTTP server answers at ``url`` (hosts that start registration before they listen: vLLM).
    """
    info = InstanceInfo(
        instance_id=instance_id,
        role=as_enum(InstanceRole, role, "role"),
        url=url,
        model=model,
        kv_endpoints=list(kv_endpoints),
        version=version,
    )
    client = HeartbeatClient(
        router_address, info, load_fn=load_fn, interval_s=interval_s, secret=secret,
        wait_for_http=wait_for_http,
    )
    client.start()
    logger.info("registering %s (%s, %s, KV endpoints %s) with router %s", instance_id, info.role.value,
                url, info.kv_endpoints, router_address)
    return client
