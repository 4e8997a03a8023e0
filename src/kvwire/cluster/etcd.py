"""A local single-member etcd for ``kvwire up --discovery etcd``, the discovery benchmark and tests.

:class:`LocalEtcd` runs the ``etcd`` binary (Debian: ``apt-get install etcd-server``) on loopback
with a data directory of its own (temporary unless given) and two free ports. :meth:`start` waits
until etcd answers (deadline); :meth:`kill` + :meth:`start` is a restart on the same data and port
(leases and records survive, as with a real etcd restart). :meth:`stop` stops it and removes a
temporary data directory. No torch.
"""

from __future__ import annotations

import shutil
import signal
import ssl
import sys
import tempfile
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

from kvwire.cluster.local import free_port
from kvwire.cluster.process import ManagedProcess, wait_until
from kvwire.discovery.address import with_tls_files
from kvwire.errors import ConfigError, KvwireError

ETCD_BINARY = "etcd"
INSTALL_HINT = "install it with `apt-get install etcd-server` (Debian/Ubuntu) or from etcd's releases"


class EtcdUnavailable(ConfigError):
    """The etcd binary is not installed."""


class EtcdStartError(KvwireError):
    """etcd did not start answering before the deadline."""


def etcd_binary() -> str | None:
    return shutil.which(ETCD_BINARY)


@dataclass(frozen=True)
class LocalEtcdTls:
    """TLS on a local etcd's client port: its certificate and key, and the CA (PEM) that signed them
    and the clients' certificates. ``client_cert``/``client_key``: a client certificate, required
    by etcd when given (``--client-cert-auth``) and used for the readiness check."""

    cert_file: str
    key_file: str
    ca_file: str
    client_cert: str | None = None
    client_key: str | None = None

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.client_cert is not None:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


class LocalEtcd:
    def __init__(self, host: str = "127.0.0.1", *, data_dir: Path | None = None,
                 sink: TextIO | None = None, tls: LocalEtcdTls | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        binary = etcd_binary()
        if binary is None:
            raise EtcdUnavailable(f"the etcd binary is not on PATH: {INSTALL_HINT}")
        self._binary = binary
        self.host = host
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self._tmp = None if data_dir is not None else tempfile.mkdtemp(prefix="kvwire-etcd-")
        self.data_dir = data_dir if data_dir is not None else Path(self._tmp or "")
        self._sink = sink if sink is not None else sys.stderr
        self._lock = threading.Lock()
        self.process: ManagedProcess | None = None
        self.tls = tls
        self.extra_args = extra_args  # more etcd flags (tests: --auth-token-ttl)

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def discovery(self) -> str:
        """The ``--discovery`` address of this etcd (default prefix; with TLS, the CA and the
        client certificate included)."""
        if self.tls is None:
            return f"etcd://{self.host}:{self.client_port}"
        return with_tls_files(f"etcd+https://{self.host}:{self.client_port}", self.tls.ca_file,
                              self.tls.client_cert, self.tls.client_key)

    def start(self, timeout_s: float = 20.0) -> LocalEtcd:
        client, peer = self.url, f"http://{self.host}:{self.peer_port}"
        argv = [
            self._binary, "--name", "kvwire", "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvwire={peer}", "--logger", "zap", "--log-level", "warn",
        ]
        if self.tls is not None:
            argv += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file,
                     "--trusted-ca-file", self.tls.ca_file]
            if self.tls.client_cert is not None:
                argv += ["--client-cert-auth"]
        argv += list(self.extra_args)
        self.process = ManagedProcess("etcd", argv, sink=self._sink, sink_lock=self._lock)
        if not wait_until(self._answers, timeout_s, 0.05):
            tail = self.process.output()[-2000:]
            self.stop()
            raise EtcdStartError(f"etcd on {client} did not answer within {timeout_s} s:\n{tail}")
        return self

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise EtcdStartError(f"etcd exited with code {self.process.poll()}:\n{self.process.output()}")
        context = self.tls.client_context() if self.tls is not None else None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0, context=context) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL etcd (its data stays, for a restart with :meth:`start`)."""
        if self.process is not None:
            self.process.expected_exit = True
            self.process.signal(signal.SIGKILL)
            self.process.wait_exit(10.0)
            self.process = None

    def wipe(self) -> None:
        """Delete etcd's data (stopped first): the next :meth:`start` is an etcd that lost everything."""
        self.kill()
        shutil.rmtree(self.data_dir / "data", ignore_errors=True)

    def stop(self) -> None:
        """Stop etcd and remove a temporary data directory (idempotent)."""
        if self.process is not None:
            self.process.stop(5.0)
            self.process = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
