"""Registering an instance for discovery: its :class:`InstanceInfo` and a running registration thread.

Shared by every host that announces itself (``kvwire serve`` through
:mod:`kvwire.server.registration`, the vLLM plugin's scheduler half), so they all announce the same
way; each keeps only its own ``load_fn``. The address picks the backend
(:func:`~kvwire.discovery.address.parse_registration_address`): ``tcp://`` -> ZeroMQ heartbeats to one
router (:class:`HeartbeatClient`), ``etcd://`` -> a leased record in etcd (:class:`EtcdRegistration`).
No torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvwire.discovery.address import DiscoveryKind, parse_registration_address
from kvwire.discovery.client import HeartbeatClient, LoadFn
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.heartbeats import InstanceInfo
from kvwire.enum_values import as_enum
from kvwire.protocol.kv_blocks import KvEventLog
from kvwire.protocol.kv_params import KVCacheLayout, Role
from kvwire.supervision import HealthBoard

logger = logging.getLogger(__name__)

Registration = HeartbeatClient | EtcdRegistration  # start(), send_now(), close() (deregisters)


def start_registration(
    router_address: str,
    *,
    instance_id: str,
    role: Role | str,
    url: str,
    model: str,
    kv_endpoints: Sequence[str],
    version: str,
    load_fn: LoadFn | None,
    interval_s: float,
    secret: str | bytes | None = None,
    kv_events: KvEventLog | None = None,
    tokenizer: str = "",
    kv_layout: KVCacheLayout | None = None,
    wait_for_http: bool = False,
    board: HealthBoard | None = None,
    kv_mode: str = "",
    max_model_len: int = 0,
) -> Registration:
    """Start registering at ``router_address`` (``etcd://HOST:PORT[/prefix]``, or ``tcp://HOST:PORT``
    of one or more routers, comma-separated: each gets every heartbeat) and return the client
    (``close()`` deregisters). ``secret`` signs ZeroMQ heartbeats and etcd records (a router with
    the secret refuses unsigned ones; decision 125). KV events travel on the ZeroMQ connections
    only: an instance registered in etcd is routed on load (decision 046).

    ``role`` is an :class:`Role` or its value (``prefill``, ``decode`` or ``both``): the
    server's and the connector's role enums share those values. ``load_fn`` runs on the heartbeat
    thread. ``kv_events``: the host's prefix-cache log, published as KV events on the same connection;
    ``tokenizer``: how the router can tokenize like this host (see ``InstanceInfo.tokenizer``).
    ``wait_for_http``: send the first heartbeat only once an HTTP server answers at ``url`` (hosts
    that start registration before they listen: vLLM; ZeroMQ only). ``board``: the host's
    :class:`~kvwire.supervision.HealthBoard` (its ``/health``), where the registration thread is supervised.
    Raises :class:`~kvwire.errors.ConfigError` for a malformed address or interval or an unknown
    role; nothing is started then.
    """
    info = InstanceInfo(
        instance_id=instance_id,
        role=as_enum(Role, role, "role"),
        url=url,
        model=model,
        kv_endpoints=list(kv_endpoints),
        version=version,
        tokenizer=tokenizer,
        kv_layout=kv_layout,
        kv_mode=kv_mode,
        max_model_len=max_model_len,
    )
    target = parse_registration_address(router_address)
    client: Registration
    if target.kind is DiscoveryKind.ETCD:
        client = EtcdRegistration(target, info, load_fn=load_fn, interval_s=interval_s, board=board,
                                  secret=secret)
    else:
        client = HeartbeatClient(
            target.address, info, load_fn=load_fn, interval_s=interval_s, secret=secret,
            kv_events=kv_events, wait_for_http=wait_for_http, board=board,
        )
    client.start()
    logger.info("registering %s (%s, %s, KV endpoints %s) at %s", instance_id, info.role.value,
                url, info.kv_endpoints, target)  # str(target): never a password
    return client
