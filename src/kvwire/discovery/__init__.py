"""Service discovery: instances announce themselves to the router with signed, versioned heartbeats.

``messages`` holds the wire types; ``client.HeartbeatClient`` is the instance side (no torch) and
``registration.start_registration`` the one way every host starts it.
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
from kvwire.discovery.registration import start_registration

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
    "start_registration",
]
