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
* ``etcd://USER[:PASSWORD]@HOST:PORT[/prefix][?password_file=FILE]`` (either scheme): etcd's
  user/password authentication (decision 099). The password comes from, in order: the address
  (visible in ``ps`` and shell history: prefer the others), ``password_file`` (its first line), the
  environment variable :data:`PASSWORD_ENV` (``KVWIRE_ETCD_PASSWORD``). :func:`with_auth` adds
  ``--discovery-user`` / ``--discovery-password-file``. ``str()`` of a parsed address never shows
  the password.

:func:`parse_discovery_address` is the only parser; it raises :class:`~kvwire.errors.ConfigError`
with the accepted forms for anything else. No torch, no third-party imports.
"""

from __future__ import annotations

import argparse
import enum
import os
import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from kvwire.errors import ConfigError

DEFAULT_ETCD_PREFIX = "/kvwire/instances/"
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
FORMS = "tcp://HOST:PORT (router heartbeats), etcd://HOST:PORT[/prefix] or etcd+https://HOST:PORT[/prefix]"
_ETCD_SCHEMES = {"etcd": "http", "etcd+http": "http", "etcd+https": "https"}
_TLS_KEYS = ("ca", "cert", "key")
_AUTH_KEYS = ("password_file",)
PASSWORD_ENV = "KVWIRE_ETCD_PASSWORD"


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
class EtcdAuth:
    """etcd user/password authentication; ``repr`` and ``str`` of an address never show the password."""

    user: str
    password: str = field(repr=False)
    password_file: str | None = None  # where the password was read from (kept for ``str``)


@dataclass(frozen=True)
class DiscoveryAddress:
    kind: DiscoveryKind
    address: str  # ZeroMQ endpoint, or the etcd client URL ``http(s)://HOST:PORT``
    prefix: str = ""  # etcd key prefix, always ending in "/" (empty for ZeroMQ)
    tls: EtcdTls | None = None  # etcd over https (None: plain http)
    auth: EtcdAuth | None = None  # etcd user/password (None: none)

    def key(self, instance_id: str) -> str:
        """The etcd key of one instance's record."""
        return self.prefix + instance_id

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context for etcd (None: plain http)."""
        return None if self.tls is None else self.tls.context()

    def __str__(self) -> str:
        """The address as parsed back by :func:`parse_discovery_address` (TLS files and the
        password file included), without a password given in the address itself."""
        if self.kind is DiscoveryKind.ZMQ:
            return self.address
        options: dict[str, str | None] = {}
        if self.tls is not None:
            options = {"ca": self.tls.ca_file, "cert": self.tls.cert_file, "key": self.tls.key_file}
        user = ""
        if self.auth is not None:
            user = quote(self.auth.user, safe="") + "@"
            options["password_file"] = self.auth.password_file
        query = urlencode({k: v for k, v in options.items() if v is not None}, safe="/", quote_via=quote)
        scheme, host = ("etcd", self.address.removeprefix("http://")) if self.tls is None else (
            "etcd+https", self.address.removeprefix("https://"))
        base = f"{scheme}://{user}{host}{self.prefix}"
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
    shown = _without_password(text, parts.password)
    files = _parse_options(shown, parts.query)
    if http == "http" and set(files) & set(_TLS_KEYS):
        raise ConfigError(f"TLS options (?ca=&cert=&key=) need an etcd+https:// address, got {shown!r}")
    tls = _tls_of(shown, files) if http == "https" else None
    auth = _auth_of(shown, parts.username, parts.password, files.get("password_file"))
    prefix = parts.path.rstrip("/")
    prefix = (prefix + "/") if prefix else DEFAULT_ETCD_PREFIX
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return DiscoveryAddress(DiscoveryKind.ETCD, f"{http}://{host}:{port}", prefix, tls, auth)


def _without_password(text: str, password: str | None) -> str:
    """``text`` fit for an error message: a password in it replaced by ``***``."""
    return text if not password else text.replace(f":{password}@", ":***@", 1)


def _parse_options(text: str, query: str) -> dict[str, str]:
    """The ``?name=file`` options of an etcd address: each a known name, once, an existing file."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise ConfigError(f"bad options in {text!r}: {exc}") from exc
    files: dict[str, str] = {}
    for name, value in pairs:
        if name not in _TLS_KEYS + _AUTH_KEYS:
            known = ", ".join(_TLS_KEYS + _AUTH_KEYS)
            raise ConfigError(f"unknown etcd option {name!r} in {text!r} (known: {known})")
        if name in files:
            raise ConfigError(f"etcd option {name!r} given twice in {text!r}")
        if not value or not os.path.isfile(value):
            raise ConfigError(f"etcd {name} file {value!r} does not exist (in {text!r})")
        files[name] = value
    return files


def _tls_of(text: str, files: dict[str, str]) -> EtcdTls:
    if ("cert" in files) != ("key" in files):
        tls_names = sorted(set(files) & set(_TLS_KEYS))
        raise ConfigError(f"etcd TLS needs cert and key together, got {tls_names} in {text!r}")
    return EtcdTls(files.get("ca"), files.get("cert"), files.get("key"))


def _auth_of(text: str, user: str | None, password: str | None, password_file: str | None) -> EtcdAuth | None:
    """The credentials of an etcd address: the password from the address, else ``password_file``
    (first line), else $KVWIRE_ETCD_PASSWORD."""
    if not user:
        if password is not None or password_file is not None:
            raise ConfigError(f"an etcd password needs a user (etcd://USER@HOST:PORT), got {text!r}")
        return None
    user = unquote(user)
    if password is not None:
        return EtcdAuth(user, unquote(password))
    if password_file is not None:
        try:
            with open(password_file, encoding="utf-8") as f:
                first = f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"etcd password file {password_file!r} unreadable: {exc}") from exc
        if not first:
            raise ConfigError(f"etcd password file {password_file!r} is empty")
        return EtcdAuth(user, first, password_file)
    env = os.environ.get(PASSWORD_ENV)
    if env:
        return EtcdAuth(user, env)
    raise ConfigError(f"etcd user {user!r} given without a password: put it in a file (?password_file= or "
                      f"--discovery-password-file) or in ${PASSWORD_ENV} (in {text!r})")


def with_auth(text: str, user: str | None = None, password_file: str | None = None) -> str:
    """``text`` with ``--discovery-user`` / ``--discovery-password-file`` added (the user into the
    address, the file to its query). Unchanged when neither is given; raises
    :class:`~kvwire.errors.ConfigError` for a ZeroMQ address or a user the address already names."""
    if not user and not password_file:
        return text
    if not text.startswith(tuple(f"{s}://" for s in _ETCD_SCHEMES)):
        raise ConfigError(f"--discovery-user/--discovery-password-file apply to etcd addresses only, "
                          f"got {text!r}")
    scheme, rest = text.split("://", 1)
    if user:
        if "@" in rest.split("/", 1)[0].split("?", 1)[0]:
            raise ConfigError(f"--discovery-user given and the address names a user too: {text!r}")
        rest = f"{quote(user, safe='')}@{rest}"
    if password_file:
        sep = "&" if "?" in rest else "?"
        rest = f"{rest}{sep}{urlencode({'password_file': password_file}, safe='/', quote_via=quote)}"
    return f"{scheme}://{rest}"


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
    """``--discovery-ca/--discovery-cert/--discovery-key`` (read back with :func:`tls_files_of`) and
    ``--discovery-user/--discovery-password-file`` (:func:`auth_of_args`)."""
    parser.add_argument("--discovery-user", default=None, metavar="USER",
                        help="etcd user (etcd's user/password authentication; same as "
                             f"etcd://USER@HOST:PORT); the password from --discovery-password-file "
                             f"or ${PASSWORD_ENV}")
    parser.add_argument("--discovery-password-file", default=None, metavar="FILE",
                        help="file holding the etcd user's password (first line; same as ?password_file=)")
    parser.add_argument("--discovery-ca", default=None, metavar="FILE",
                        help="etcd over TLS: the CA bundle (PEM) that signed etcd's certificate "
                             "(default: the system's; same as ?ca= in an etcd+https:// address)")
    parser.add_argument("--discovery-cert", default=None, metavar="FILE",
                        help="etcd over TLS: this client's certificate (PEM), for --client-cert-auth")
    parser.add_argument("--discovery-key", default=None, metavar="FILE",
                        help="etcd over TLS: the key of --discovery-cert (PEM)")


def tls_files_of(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    return args.discovery_ca, args.discovery_cert, args.discovery_key


def auth_of_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    return args.discovery_user, args.discovery_password_file


def with_discovery_options(text: str, args: argparse.Namespace) -> str:
    """``text`` with the TLS and authentication options of :func:`add_tls_arguments` added."""
    return with_auth(with_tls_files(text, *tls_files_of(args)), *auth_of_args(args))
