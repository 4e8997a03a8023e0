"""Service discovery: instances announce themselves to the router with signed, versioned heartbeats.

``heartbeats`` holds the wire types; ``client.HeartbeatClient`` (ZeroMQ) and
``etcd_client.EtcdRegistration`` (etcd lease + record) are the instance side (no torch) and
``registration.start_registration`` the one way every host starts it.
The router side lives in ``kvwire.router.listener`` / ``kvwire.router.registry``.

The names below are imported on first use (PEP 562): ``kvwire.discovery.address`` (what the vLLM
plugin's config parses) imports neither ZeroMQ nor the clients.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvwire.discovery.address import DiscoveryAddress, DiscoveryKind, parse_discovery_address
    from kvwire.discovery.client import HeartbeatClient
    from kvwire.discovery.etcd_client import EtcdRegistration
    from kvwire.discovery.heartbeats import (
        DISCOVERY_VERSION,
        Deregister,
        DiscoveryMessage,
        Heartbeat,
        InstanceInfo,
        InstanceLoad,
        decode_frames,
        encode_frames,
        new_epoch,
    )
    from kvwire.discovery.registration import Registration, start_registration
    from kvwire.protocol.kv_params import Role

_HOMES = {
    "DiscoveryAddress": "address",
    "DiscoveryKind": "address",
    "parse_discovery_address": "address",
    "HeartbeatClient": "client",
    "EtcdRegistration": "etcd_client",
    "DISCOVERY_VERSION": "heartbeats",
    "Deregister": "heartbeats",
    "DiscoveryMessage": "heartbeats",
    "Heartbeat": "heartbeats",
    "InstanceInfo": "heartbeats",
    "InstanceLoad": "heartbeats",
    "Role": "heartbeats",
    "decode_frames": "heartbeats",
    "encode_frames": "heartbeats",
    "new_epoch": "heartbeats",
    "Registration": "registration",
    "start_registration": "registration",
}

__all__ = [
    "DISCOVERY_VERSION",
    "Deregister",
    "DiscoveryAddress",
    "DiscoveryKind",
    "DiscoveryMessage",
    "EtcdRegistration",
    "Heartbeat",
    "HeartbeatClient",
    "InstanceInfo",
    "InstanceLoad",
    "Registration",
    "Role",
    "decode_frames",
    "encode_frames",
    "new_epoch",
    "parse_discovery_address",
    "start_registration",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvwire.discovery' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvwire.discovery.{home}"), name)
