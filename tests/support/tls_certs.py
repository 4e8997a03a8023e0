"""Throw-away TLS certificates for tests: a CA, a server certificate for 127.0.0.1 and a client
certificate, made with the ``openssl`` command (EC P-256, valid one day). No third-party package.

The server certificate is also good for client authentication: etcd's JSON gateway calls etcd's
gRPC side with it, and an etcd started with ``--client-cert-auth`` checks it like any client's."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl")


@dataclass(frozen=True)
class CertFiles:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _run(*argv: str) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *argv], check=True, capture_output=True, timeout=30)


def _signed(d: Path, name: str, cn: str, ext: str, ca: Path, ca_key: Path) -> tuple[str, str]:
    key, csr, cert, extfile = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    extfile.write_text(ext)
    _run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-out", str(cert), "-days", "1", "-extfile", str(extfile))
    return str(cert), str(key)


def make_certs(directory: Path, prefix: str = "") -> CertFiles:
    """A CA and two certificates signed by it, under ``directory`` (``prefix`` names a second set)."""
    ca, ca_key = directory / f"{prefix}ca.pem", directory / f"{prefix}ca.key"
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(ca_key), "-out", str(ca), "-days", "1", "-subj", f"/CN=kvwire test CA {prefix}")
    server_ext = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    server = _signed(directory, f"{prefix}server", "127.0.0.1", server_ext, ca, ca_key)
    client = _signed(directory, f"{prefix}client", "kvwire-client", "extendedKeyUsage=clientAuth\n",
                     ca, ca_key)
    return CertFiles(str(ca), *server, *client)
