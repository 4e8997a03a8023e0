"""Where an instance registers and a router discovers: one URL, parsed once.

* ``tcp://HOST:PORT`` (also ``ipc://``, ``inproc://``): the router's embedded ZeroMQ heartbeat socket
  (the default backend; nothing to install).
* ``etcd://HOST:PORT[/prefix]``: an etcd v3 cluster; instances keep a leased record under
  ``prefix`` (default :data:`DEFAULT_ETCD_PREFIX`), routers watch that prefix.

:func:`parse_discovery_address` is the only parser; it raises :class:`~kvwire.errors.ConfigError`
with the accepted forms for anything else. No torch, no third-party imports.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvwire.errors import ConfigError

DEFAULT_ETCD_PREFIX = "/kvwire/instances/"
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
FORMS = "tcp://HOST:PORT (router heartbeats) or etcd://HOST:PORT[/prefix]"


class DiscoveryKind(str, enum.Enum):
    ZMQ = "zmq"  # embedded: heartbeats to one router's ZeroMQ socket
    ETCD = "etcd"  # leased records in etcd, watched by any number of routers


@dataclass(frozen=True)
class DiscoveryAddress:
    kind: DiscoveryKind
    address: str  # ZeroMQ endpoint, or the etcd client URL ``http://HOST:PORT``
    prefix: str = ""  # etcd key prefix, always ending in "/" (empty for ZeroMQ)

    def key(self, instance_id: str) -> str:
        """The etcd key of one instance's record."""
        return self.prefix + instance_id

    def __str__(self) -> str:
        if self.kind is DiscoveryKind.ZMQ:
            return self.address
        return f"etcd://{self.address.removeprefix('http://')}{self.prefix}"


def parse_discovery_address(text: str) -> DiscoveryAddress:
    """``tcp://HOST:PORT`` or ``etcd://HOST:PORT[/prefix]`` -> :class:`DiscoveryAddress`."""
    if text.startswith(_ZMQ_SCHEMES):
        return DiscoveryAddress(DiscoveryKind.ZMQ, text)
    if not text.startswith("etcd://"):
        raise ConfigError(f"discovery address must be {FORMS}, got {text!r}")
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad port in discovery address {text!r}") from exc
    if not parts.hostname or port is None:
        raise ConfigError(f"etcd discovery address must be etcd://HOST:PORT[/prefix], got {text!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"etcd discovery address takes no query or fragment, got {text!r}")
    prefix = parts.path.rstrip("/")
    prefix = (prefix + "/") if prefix else DEFAULT_ETCD_PREFIX
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return DiscoveryAddress(DiscoveryKind.ETCD, f"http://{host}:{port}", prefix)


def parse_registration_address(text: str) -> DiscoveryAddress:
    """Where an instance registers: ``etcd://HOST:PORT[/prefix]``, or one or more router heartbeat
    sockets separated by commas (``tcp://A:P,tcp://B:P``: router high availability, each gets
    every heartbeat). Raises :class:`~kvwire.errors.ConfigError` for anything else, including an
    etcd address in a list (etcd already serves every router)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ConfigError(f"discovery address must be {FORMS}, got {text!r}")
    parsed = [parse_discovery_address(part) for part in parts]
    if len(parsed) > 1 and any(p.kind is DiscoveryKind.ETCD for p in parsed):
        raise ConfigError(f"an etcd discovery address stands alone (every router watches it), got {text!r}")
    if len(parsed) == 1:
        return parsed[0]
    return DiscoveryAddress(DiscoveryKind.ZMQ, ",".join(p.address for p in parsed))
