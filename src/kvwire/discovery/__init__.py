"""Service discovery: instances announce themselves to the router with signed, versioned heartbeats.

``messages`` holds the wire types; ``client.HeartbeatClient`` is the instance side (no torch).
The router side lives in ``kvwire.router.listener`` / ``kvwire.router.registry``.
"""

from __future__ import annotations

from kvwire.discovery.client import HeartbeatClient
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

__all__ = [
    "DISCOVERY_VERSION",
    "Deregister",
    "DiscoveryMessage",
    "Heartbeat",
    "HeartbeatClient",
    "InstanceInfo",
    "InstanceLoad",
    "InstanceRole",
    "decode_frames",
    "encode_frames",
    "new_epoch",
]
