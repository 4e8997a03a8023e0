"""Where an instance registers and a router discovers: one URL, parsed once.

* ``tcp://HOST:PORT`` (also ``ipc://``, ``inproc://``): the router's embedded ZeroMQ heartbeat socket
  (the default backend; nothing to install).
* ``etcd://HOST:PORT[/prefix]``: an etcd v3 cluster; instances keep a leased record under
  ``prefix`` (default :data:`DEFAULT_ETCD_PREFIX`), routers watch that prefix.
* ``etcd+https://HOST:PORT[/prefix][?ca=FILE&cert=FILE&key=FILE]``: the same over TLS. ``ca``: the
  PEM bundle that signed etcd's certificate (default: the system's trust store); ``cert`` + ``key``:
  this client's certificate and key, for an etcd started with ``--client-cert-auth``. The files
  travel inside the address, so every place that takes one (``kvwire router --discovery``,
  ``kvwire serve --router``, the vLLM plugin's ``discovery``) takes TLS too;
  :func:`with_tls_files` adds them from separate options (``--discovery-ca/-cert/-key``).

:func:`parse_discovery_address` is the only parser; it raises :class:`~kvwire.errors.ConfigError`
with the accepted forms for anything else. No torch, no third-party imports.
"""

from __future__ import annotations

import argparse
import enum
import os
import ssl
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from kvwire.errors import ConfigError

DEFAULT_ETCD_PREFIX = "/kvwire/instances/"
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
FORMS = "tcp://HOST:PORT (router heartbeats), etcd://HOST:PORT[/prefix] or etcd+https://HOST:PORT[/prefix]"
_ETCD_SCHEMES = {"etcd": "http", "etcd+http": "http", "etcd+https": "https"}
_TLS_KEYS = ("ca", "cert", "key")


class DiscoveryKind(str, enum.Enum):
    ZMQ = "zmq"  # embedded: heartbeats to one router's ZeroMQ socket
    ETCD = "etcd"  # leased records in etcd, watched by any number of routers


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd: files checked to exist when parsed; :meth:`context` loads them."""

    ca_file: str | None = None  # None: the system's trust store
    cert_file: str | None = None  # client certificate (PEM), with key_file
    key_file: str | None = None

    def context(self) -> ssl.SSLContext:
        """A client context verifying etcd's certificate and host name; raises
        :class:`~kvwire.errors.ConfigError` for files that are not PEM certificates/keys."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"etcd TLS files (ca={self.ca_file}, cert={self.cert_file}, "
                              f"key={self.key_file}) unusable: {exc}") from exc
        return ctx


@dataclass(frozen=True)
class DiscoveryAddress:
    kind: DiscoveryKind
    address: str  # ZeroMQ endpoint, or the etcd client URL ``http(s)://HOST:PORT``
    prefix: str = ""  # etcd key prefix, always ending in "/" (empty for ZeroMQ)
    tls: EtcdTls | None = None  # etcd over https (None: plain http)

    def key(self, instance_id: str) -> str:
        """The etcd key of one instance's record."""
        return self.prefix + instance_id

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context for etcd (None: plain http)."""
        return None if self.tls is None else self.tls.context()

    def __str__(self) -> str:
        """The address as parsed back by :func:`parse_discovery_address` (TLS files included)."""
        if self.kind is DiscoveryKind.ZMQ:
            return self.address
        if self.tls is None:
            return f"etcd://{self.address.removeprefix('http://')}{self.prefix}"
        files = {"ca": self.tls.ca_file, "cert": self.tls.cert_file, "key": self.tls.key_file}
        query = urlencode({k: v for k, v in files.items() if v is not None}, safe="/", quote_via=quote)
        base = f"etcd+https://{self.address.removeprefix('https://')}{self.prefix}"
        return f"{base}?{query}" if query else base


def parse_discovery_address(text: str) -> DiscoveryAddress:
    """``tcp://HOST:PORT`` or ``etcd://HOST:PORT[/prefix]`` -> :class:`DiscoveryAddress`."""
    if text.startswith(_ZMQ_SCHEMES):
        return DiscoveryAddress(DiscoveryKind.ZMQ, text)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme not in _ETCD_SCHEMES:
        raise ConfigError(f"discovery address must be {FORMS}, got {text!r}")
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad port in discovery address {text!r}") from exc
    if not parts.hostname or port is None:
        raise ConfigError(f"etcd discovery address must be etcd://HOST:PORT[/prefix], got {text!r}")
    if parts.fragment:
        raise ConfigError(f"etcd discovery address takes no fragment, got {text!r}")
    http = _ETCD_SCHEMES[scheme]
    tls = _parse_tls(text, parts.query) if http == "https" else None
    if http == "http" and parts.query:
        raise ConfigError(f"TLS options (?ca=&cert=&key=) need an etcd+https:// address, got {text!r}")
    prefix = parts.path.rstrip("/")
    prefix = (prefix + "/") if prefix else DEFAULT_ETCD_PREFIX
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return DiscoveryAddress(DiscoveryKind.ETCD, f"{http}://{host}:{port}", prefix, tls)


def _parse_tls(text: str, query: str) -> EtcdTls:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise ConfigError(f"bad TLS options in {text!r}: {exc}") from exc
    files: dict[str, str] = {}
    for name, value in pairs:
        if name not in _TLS_KEYS:
            raise ConfigError(f"unknown etcd option {name!r} in {text!r} (known: ca, cert, key)")
        if name in files:
            raise ConfigError(f"etcd option {name!r} given twice in {text!r}")
        if not value or not os.path.isfile(value):
            raise ConfigError(f"etcd TLS {name} file {value!r} does not exist (in {text!r})")
        files[name] = value
    if ("cert" in files) != ("key" in files):
        raise ConfigError(f"etcd TLS needs cert and key together, got {sorted(files)} in {text!r}")
    return EtcdTls(files.get("ca"), files.get("cert"), files.get("key"))


def with_tls_files(text: str, ca: str | None = None, cert: str | None = None, key: str | None = None) -> str:
    """``text`` with TLS files given as separate options (``--discovery-ca/-cert/-key``) added to
    its query; ``etcd://`` becomes ``etcd+https://``. Unchanged when no file is given; raises
    :class:`~kvwire.errors.ConfigError` for a ZeroMQ address (its transport is not TLS)."""
    extra = {k: v for k, v in (("ca", ca), ("cert", cert), ("key", key)) if v}
    if not extra:
        return text
    if not text.startswith(tuple(f"{s}://" for s in _ETCD_SCHEMES)):
        raise ConfigError(f"--discovery-ca/-cert/-key apply to etcd addresses only, got {text!r}")
    rest = text.split("://", 1)[1]
    sep = "&" if "?" in rest else "?"
    return f"etcd+https://{rest}{sep}{urlencode(extra, safe='/', quote_via=quote)}"


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


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--discovery-ca/--discovery-cert/--discovery-key`` (read back with :func:`tls_files_of`)."""
    parser.add_argument("--discovery-ca", default=None, metavar="FILE",
                        help="etcd over TLS: the CA bundle (PEM) that signed etcd's certificate "
                             "(default: the system's; same as ?ca= in an etcd+https:// address)")
    parser.add_argument("--discovery-cert", default=None, metavar="FILE",
                        help="etcd over TLS: this client's certificate (PEM), for --client-cert-auth")
    parser.add_argument("--discovery-key", default=None, metavar="FILE",
                        help="etcd over TLS: the key of --discovery-cert (PEM)")


def tls_files_of(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    return args.discovery_ca, args.discovery_cert, args.discovery_key
