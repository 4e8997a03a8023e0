"""etcd over TLS with a real etcd: an instance registers and a router watches through
``etcd+https://`` with a client certificate; what lacks the right certificate is refused.

Needs the ``etcd`` binary (installed by ``scripts/test.sh``) and the ``openssl`` command (certificates
are made per test); skipped, saying so, where either is missing.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.etcd import INSTALL_HINT, LocalEtcd, LocalEtcdTls, etcd_binary
from kvwire.discovery.address import parse_discovery_address, with_tls_files
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.etcd_gateway import EtcdError, EtcdHttp
from kvwire.discovery.heartbeats import InstanceInfo, InstanceLoad
from kvwire.protocol.kv_params import Role
from kvwire.router.discovery_backend import EtcdDiscovery
from kvwire.router.registry import Registry
from support.tls_certs import OPENSSL, CertFiles, make_certs

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None, reason=f"etcd binary not installed: {INSTALL_HINT}"),
    pytest.mark.skipif(OPENSSL is None, reason="openssl (makes the test certificates) is missing"),
]


@pytest.fixture
def certs(tmp_path: Path) -> CertFiles:
    return make_certs(tmp_path)


@pytest.fixture
def etcd(certs: CertFiles) -> Iterator[LocalEtcd]:
    tls = LocalEtcdTls(certs.server_cert, certs.server_key, certs.ca, certs.client_cert, certs.client_key)
    with LocalEtcd(tls=tls) as server:
        yield server


async def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


def test_register_and_watch_over_tls_with_a_client_certificate(etcd: LocalEtcd, certs: CertFiles) -> None:
    address = etcd.discovery
    assert address.startswith("etcd+https://") and "cert=" in address
    target = parse_discovery_address(address)
    info = InstanceInfo(instance_id="tls-0", role=Role.DECODE, url="http://127.0.0.1:9", model="m")

    async def scenario() -> None:
        registry = Registry(ttl_s=3.0)
        watcher = EtcdDiscovery(registry, target)
        await watcher.start()
        reg = EtcdRegistration(target, info, load_fn=lambda: InstanceLoad(num_running=1), interval_s=0.5)
        try:
            reg.start()
            await _wait(lambda: registry.get("tls-0") is not None, 10, "the instance in the router's view")
            assert not watcher.stale and reg.dropped == 0
            view = registry.get("tls-0")
            assert view is not None and view.load == InstanceLoad(num_running=1)
            await asyncio.to_thread(reg.close)  # revokes its lease over TLS: gone at once
            await _wait(lambda: registry.get("tls-0") is None, 5, "the instance deregistered")
        finally:
            await asyncio.to_thread(reg.close)
            await watcher.stop()

    asyncio.run(scenario())


def test_without_the_right_certificates_etcd_is_refused(
    etcd: LocalEtcd, certs: CertFiles, tmp_path: Path
) -> None:
    host_port = etcd.url.removeprefix("https://")
    # No client certificate: etcd (--client-cert-auth) refuses the handshake.
    no_cert = EtcdHttp(etcd.url, timeout_s=3.0, ssl_context=ssl.create_default_context(cafile=certs.ca))
    with pytest.raises(EtcdError, match="unreachable"):
        no_cert.grant(3)
    # A client that trusts another CA does not accept etcd's certificate.
    other = make_certs(tmp_path, prefix="other-")
    wrong_ca = parse_discovery_address(with_tls_files(f"etcd://{host_port}", other.ca, certs.client_cert,
                                                      certs.client_key))
    with pytest.raises(EtcdError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        EtcdHttp(wrong_ca.address, timeout_s=3.0, ssl_context=wrong_ca.ssl_context()).grant(3)
    # Plain http to a TLS port: an error, not a hang.
    with pytest.raises(EtcdError):
        EtcdHttp(f"http://{host_port}", timeout_s=3.0).grant(3)
    # The right files: granted.
    good = parse_discovery_address(etcd.discovery)
    http = EtcdHttp(good.address, timeout_s=3.0, ssl_context=good.ssl_context())
    lease = http.grant(3)
    assert lease > 0
    http.revoke(lease)
    http.close()
