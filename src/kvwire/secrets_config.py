"""The cluster secret at the edges (decision 124): where it comes from, how long it must be, and the
refusal to listen beyond loopback without it.

A secret comes from a file (``--secret-file``, or the vLLM plugin's ``secret_file``) or from the
``KVWIRE_SECRET`` environment variable, never from a command line (``ps`` shows those to every user);
``kvwire up`` generates one per cluster and hands it to its children in their environment. It is at
least :data:`MIN_SECRET_BYTES` long (``kvwire secret`` prints a fresh one) and never logged.

``kvwire router`` and ``kvwire serve`` refuse to bind a non-loopback address without a secret, and an
HTTP port beyond loopback without an API key, unless ``--insecure`` is given: the refusal says what
to do.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvwire.errors import ConfigError

SECRET_ENV = "KVWIRE_SECRET"
MIN_SECRET_BYTES = 32
_MAX_SECRET_FILE_BYTES = 4096


def generate_secret() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(MIN_SECRET_BYTES)


def check_secret(secret: str, where: str) -> str:
    """``secret`` if it is long enough, else ConfigError naming ``where`` it came from (not its value)."""
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise ConfigError(f"the secret from {where} is {len(secret.encode())} bytes; at least "
                          f"{MIN_SECRET_BYTES} are needed (`kvwire secret` prints a fresh one)")
    return secret


def read_secret_file(path: str) -> str:
    """The secret stored in ``path`` (surrounding whitespace, e.g. a final newline, removed)."""
    try:
        with open(Path(path), "rb") as f:
            data = f.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the secret file {path}: {exc.strerror or exc}") from exc
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"the secret file {path} is larger than {_MAX_SECRET_FILE_BYTES} bytes")
    try:
        text = data.decode().strip()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the secret file {path} is not UTF-8 text") from exc
    return check_secret(text, f"the file {path}")


def load_secret(secret_file: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The secret from ``secret_file`` if given, else from ``$KVWIRE_SECRET``, else None."""
    if secret_file:
        return read_secret_file(secret_file)
    value = environ.get(SECRET_ENV, "")
    return check_secret(value, f"${SECRET_ENV}") if value else None


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for wildcards and everything else."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(
    component: str, http_host: str, other_hosts: Sequence[str], *, secret: bool, api_key: bool,
    insecure: bool,
) -> None:
    """Refuse (ConfigError) to listen beyond loopback without a secret, or with the HTTP port beyond
    loopback without an API key, unless ``insecure``."""
    if insecure:
        return
    exposed = [h for h in (http_host, *other_hosts) if not is_loopback(h)]
    if exposed and not secret:
        raise ConfigError(
            f"{component} would listen on {exposed[0]} (not loopback) with no shared secret: anyone who "
            f"reaches it could register instances or direct KV transfers. Set {SECRET_ENV} or "
            "--secret-file on every process of the cluster (`kvwire secret` prints one), or pass "
            "--insecure on a trusted network"
        )
    if not is_loopback(http_host) and not api_key:
        raise ConfigError(
            f"{component} would serve HTTP on {http_host} (not loopback) with no API key. Set "
            "KVWIRE_API_KEY or --api-key, or pass --insecure on a trusted network"
        )


def add_secret_arguments(parser: argparse.ArgumentParser) -> None:
    """``--secret-file`` and ``--insecure`` (one block, the same on every command)."""
    group = parser.add_argument_group("cluster secret (decision 124)")
    group.add_argument("--secret-file", default=None, metavar="PATH",
                       help=f"file holding the shared secret (default: ${SECRET_ENV}, else none); "
                            f"at least {MIN_SECRET_BYTES} bytes, `kvwire secret` prints one")
    group.add_argument("--insecure", action="store_true",
                       help="allow listening beyond loopback without a secret or an API key")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvwire secret``: no options."""


def run(args: argparse.Namespace) -> int:
    """``kvwire secret``: print a fresh secret (store it in a file, give --secret-file or KVWIRE_SECRET)."""
    print(generate_secret())
    return 0
