"""Service discovery: instances announce themselves to the router with signed, versioned heartbeats.

``messages`` holds the wire types; ``client.HeartbeatClient`` (ZeroMQ) and
``etcd_client.EtcdRegistration`` (etcd lease + record) are the instance side (no torch) and
``registration.start_registration`` the one way every host starts it.
The router side lives in ``kvwire.router.listener`` / ``kvwire.router.registry``.
"""

from __future__ import annotations

from kvwire.discovery.address import DiscoveryAddress, DiscoveryKind, parse_discovery_address
from kvwire.discovery.client import HeartbeatClient
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.messages import (
    DISCOVERY_VERSION,
    Deregister,
    DiscoveryMessage,
    Heartbeat,
    InstanceInfo,
    InstanceLoad,
    InstanceRole,
    decode_frames,
    encode_frames,
    new_epoch,
)
from kvwire.discovery.registration import Registration, start_registration

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
    "InstanceRole",
    "Registration",
    "decode_frames",
    "encode_frames",
    "new_epoch",
    "parse_discovery_address",
    "start_registration",
]
