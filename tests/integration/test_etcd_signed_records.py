"""Signed etcd records (decision 124): with the cluster secret, a router watching etcd registers only
instances whose records are signed with it; a record written by anyone else who can write to etcd
(unsigned, or signed with another key) is dropped and counted. Real etcd, loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from kvwire.cluster.etcd import INSTALL_HINT, LocalEtcd, etcd_binary
from kvwire.discovery import InstanceInfo, parse_discovery_address
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.etcd_gateway import EtcdHttp, encode_record
from kvwire.discovery.messages import Heartbeat
from kvwire.kv_params import Role
from kvwire.router.discovery_backend import EtcdDiscovery
from kvwire.router.registry import Registry

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=f"etcd binary not installed: {INSTALL_HINT}")
SECRET = b"etcd-record-secret-0123456789abcdef"


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def _info(ident: str) -> InstanceInfo:
    return InstanceInfo(instance_id=ident, role=Role.DECODE, url=f"http://127.0.0.1:9/{ident}", model="m")


def test_forged_records_are_dropped_and_signed_ones_register(etcd: LocalEtcd) -> None:
    target = parse_discovery_address(etcd.discovery)
    http = EtcdHttp(target.address, timeout_s=3.0)
    lease = http.grant(30)
    for ident, secret in (("forged-unsigned", None), ("forged-other-key", b"x" * 40)):
        hb = Heartbeat(info=_info(ident), seq=1, sent_at=time.time())
        http.put(target.key(ident), encode_record(hb, secret), lease)
    honest = EtcdRegistration(target, _info("honest"), interval_s=0.5, secret=SECRET)

    async def scenario() -> None:
        registry = Registry(ttl_s=100.0)
        watcher = EtcdDiscovery(registry, target, secret=SECRET)
        await watcher.start()
        try:
            honest.start()
            deadline = time.monotonic() + 20
            while registry.get("honest") is None or watcher.dropped["unauthenticated"] < 2:
                assert time.monotonic() < deadline, (dict(watcher.dropped), registry.snapshot())
                await asyncio.sleep(0.05)
            assert registry.get("forged-unsigned") is None and registry.get("forged-other-key") is None
        finally:
            honest.close()
            await watcher.stop()

    try:
        asyncio.run(scenario())
    finally:
        http.close()
