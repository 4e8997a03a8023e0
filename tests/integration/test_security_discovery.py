"""Attacks on discovery and on the router's front door against real processes (decision 125).

* etcd discovery with a shared secret (etcd, router, prefill and decode processes): the instances'
  records are signed and served on; records written by someone with etcd access but without the
  secret (unsigned, signed with another secret, claiming a live instance's URL) are refused; a
  signed record put back after its instance left is refused as a replay.
* Without a secret (the development default, loopback only) anyone who reaches discovery registers:
  asserted, so that the threat model's "nothing" row stays true to the code.
* ``/instances`` opened to everyone (``--open-endpoint instances``) with API keys: no addresses
  for callers without a key.
* Client-chosen ``kv_transfer_params`` through the router, and a non-loopback bind without a
  secret: the router's and the CLI's side (branch ``secure``).

The ZeroMQ attacks on a cluster with a secret are in test_security.py. etcd tests need the ``etcd``
binary (``scripts/install_etcd.sh``) and are skipped, saying so, only where it is missing.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_security import API_KEY, SECRET, _dropped, _instances, _push, _trap, assert_serving, call

from kvwire.cluster.etcd import INSTALL_HINT, etcd_binary
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.cluster.process import kvwire_argv
from kvwire.discovery import parse_discovery_address
from kvwire.discovery.etcd_gateway import EtcdHttp, b64, decode_record, encode_record, record_key, unb64
from kvwire.discovery.heartbeats import Heartbeat, InstanceInfo, InstanceLoad, encode_frames
from kvwire.http.front_door import ApiKeyConfig
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from support.mock_instance import MockProcess, RouterThread, router_config
from support.pd_cluster_helpers import running_cluster
from support.waiting import wait_for

pytestmark = pytest.mark.slow
needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason=f"etcd binary not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    log_path = tmp_path_factory.mktemp("security-etcd") / "cluster.log"
    spec = ClusterSpec(num_prefill=1, num_decode=1, discovery="etcd", heartbeat_interval_s=0.5,
                       kv_deadline_s=5.0, api_key=API_KEY, secret=SECRET)
    with running_cluster(spec, log_path) as cluster:
        yield cluster, log_path


def _record(http: EtcdHttp, key: str) -> bytes:
    kvs = http.call("/v3/kv/range", {"key": b64(key)}).get("kvs", [])
    assert len(kvs) == 1, f"no record at {key}"
    return unb64(kvs[0]["value"])


@needs_etcd
def test_etcd_records_are_signed_and_forged_ones_refused(etcd_cluster: tuple[LocalCluster, Path]) -> None:
    cluster, log_path = etcd_cluster
    router = cluster.router_url
    target = parse_discovery_address(cluster.discovery_address)
    http = EtcdHttp(target.address, timeout_s=5.0)
    trap, trap_address = _trap()
    try:
        assert_serving(cluster)  # the instances' signed records are accepted: P/D works
        genuine = decode_record(_record(http, target.key("decode-0")), record_key(SECRET))
        assert genuine.info.instance_id == "decode-0"
        before = _dropped(router, "unauthenticated")
        lease = http.grant(60)  # an attacker who may write to etcd, without the secret
        intruder = InstanceInfo(instance_id="intruder", role=Role.DECODE, url=f"http://{trap_address}",
                                model="tiny", kv_endpoints=[f"tcp://{trap_address}"])
        usurper = InstanceInfo(instance_id="usurper", role=Role.DECODE, url=genuine.info.url, model="tiny")
        forged = [(intruder, None), (intruder, record_key("not-the-cluster-secret")), (usurper, None)]
        for info, key in forged:
            record = Heartbeat(info=info, seq=1, sent_at=time.time(), ttl_s=30.0)
            http.put(target.key(info.instance_id), encode_record(record, key), lease)
        wait_for(lambda: _dropped(router, "unauthenticated") >= before + 3, 30.0, "forged records dropped",
                 interval_s=0.1)
        entries = _instances(router)
        assert set(entries) == {"prefill-0", "decode-0"} and all(e["alive"] for e in entries.values())
        assert_serving(cluster)
        assert select.select([trap], [], [], 0)[0] == []
        http.revoke(lease)
    finally:
        trap.close()
        http.close()
    assert log_path.read_text().count("refused etcd record (unauthenticated)") == 1


@needs_etcd
def test_etcd_record_put_back_after_its_instance_left_is_a_replay(
    etcd_cluster: tuple[LocalCluster, Path]
) -> None:
    """A mock instance with the secret registers; its signed record, read from etcd (anyone who may
    read the prefix can), is put back after it left: the router must not take it back."""
    cluster, _ = etcd_cluster
    router = cluster.router_url
    target = parse_discovery_address(cluster.discovery_address)
    http = EtcdHttp(target.address, timeout_s=5.0)
    ghost = MockProcess(cluster.discovery_address, "ghost", "--role", "decode", "--model", "ghost-model",
                        "--secret", SECRET, "--interval-s", "0.5")
    try:
        wait_for(lambda: "ghost" in _instances(router), 30.0, "the ghost registers", interval_s=0.1)
        captured = _record(http, target.key("ghost"))
        ghost.stop()  # revokes its lease: the record goes, the router drops it
        wait_for(lambda: "ghost" not in _instances(router), 30.0, "the ghost leaves", interval_s=0.1)
        before = _dropped(router, "replayed")
        lease = http.grant(60)
        http.put(target.key("ghost"), captured, lease)
        wait_for(lambda: _dropped(router, "replayed") >= before + 1, 30.0, "the replay dropped",
                 interval_s=0.1)
        assert "ghost" not in _instances(router)
        http.revoke(lease)
    finally:
        ghost.kill()
        http.close()


@needs_etcd
def test_without_a_secret_anyone_registers(etcd_cluster: tuple[LocalCluster, Path]) -> None:
    """The threat model's "no secret" rows: a router without the secret takes an unsigned etcd record
    and an unsigned ZeroMQ heartbeat from anybody (use a secret, or bind to 127.0.0.1 only)."""
    cluster, _ = etcd_cluster
    target = parse_discovery_address(cluster.discovery_address)
    http = EtcdHttp(target.address, timeout_s=5.0)
    etcd_router, zmq_router = (RouterThread(router_config(discovery=cluster.discovery_address)),
                               RouterThread(router_config(instance_ttl_s=30.0)))
    try:
        lease = http.grant(60)
        info = InstanceInfo(instance_id="anyone", role=Role.BOTH, url="http://127.0.0.1:9", model="m")
        http.put(target.key("anyone"), encode_record(Heartbeat(info=info, seq=1, sent_at=time.time())), lease)
        _push(zmq_router.discovery, [encode_frames(Heartbeat(info=info, seq=1, sent_at=0.0))])
        for router in (etcd_router, zmq_router):
            wait_for(lambda r=router: "anyone" in _instances(r.url), 30.0, "registered", interval_s=0.1)
        http.revoke(lease)
    finally:
        etcd_router.close()
        zmq_router.close()
        http.close()


def test_open_instances_endpoint_hides_addresses_without_a_key() -> None:
    """``--open-endpoint instances`` with API keys: callers without a valid key see who is there, but
    no URL, KV endpoint or data-plane peer to aim at; key holders see everything."""
    keys = ApiKeyConfig((API_KEY,), frozenset({"/instances"}))
    router = RouterThread(router_config(instance_ttl_s=30.0, api_keys=keys))
    try:
        info = InstanceInfo(instance_id="d0", role=Role.DECODE, url="http://127.0.0.1:9", model="m",
                            kv_endpoints=["tcp://127.0.0.1:10"])
        load = InstanceLoad(kv_transports={"tcp://127.0.0.1:11": "tcp"})
        _push(router.discovery, [encode_frames(Heartbeat(info=info, load=load, seq=1, sent_at=time.time()))])
        wait_for(lambda: "d0" in _instances(router.url), 30.0, "registered", interval_s=0.1)
        for key in (None, "sk-wrong-key-0000"):
            status, entries = call(f"{router.url}/instances", key=key)
            assert status == 200 and entries[0]["id"] == "d0"
            assert (entries[0]["url"], entries[0]["kv_endpoints"]) == (None, [])
            assert entries[0]["load"]["kv_transports"] == {}
        full = _instances(router.url)["d0"]
        assert full["url"] == info.url and full["kv_endpoints"] == info.kv_endpoints
        assert full["load"]["kv_transports"] == load.kv_transports
    finally:
        router.close()


# --- the router's front door (decision 124) ---


@pytest.fixture(scope="module")
def open_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """No secret, no key: what `kvwire up` on one host ran before secure-by-default."""
    log_path = tmp_path_factory.mktemp("security-open") / "cluster.log"
    spec = ClusterSpec(num_prefill=1, num_decode=1, heartbeat_interval_s=0.5, kv_deadline_s=5.0)
    with running_cluster(spec, log_path) as cluster:
        yield cluster


def test_client_kv_transfer_params_never_reach_an_instance(open_cluster: LocalCluster) -> None:
    """Trap parameters in the client's body, twice: the first request goes through P/D, the second
    is a prefix hit on D (kv_aware skips P and sends the body to D). The trap is never touched."""
    router = open_cluster.router_url
    trap, trap_address = _trap()
    prompt = [(5 * i) % 200 + 3 for i in range(40)]  # two full blocks: D caches them
    try:
        params = KVTransferParams(transfer_id=uuid.uuid4().hex, mode=TransferMode.PULL, role=Role.DECODE,
                                  peer_endpoints=[f"tcp://{trap_address}"], peer_instance_id="prefill-0")
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                "kv_transfer_params": params.to_dict()}
        status, answer = call(f"{router}/v1/completions", body, key=None)
        assert status == 200, answer
        wait_for(lambda: _instances_open(router)["decode-0"]["kv_cache"]["cached_blocks"] > 0, 30.0,
                 "D's cached prompt known to the router", interval_s=0.1)
        status, answer = call(f"{router}/v1/completions", body, key=None)
        assert status == 200, answer
        assert select.select([trap], [], [], 0)[0] == []
    finally:
        trap.close()


def _instances_open(router: str) -> dict[str, dict[str, Any]]:
    status, entries = call(f"{router}/instances", key=None)
    assert status == 200, entries
    return {entry["id"]: entry for entry in entries}


@pytest.mark.parametrize("command", [("router", "--port", "0", "--discovery-port", "0"),
                                     ("serve", "--model", "tiny", "--port", "0", "--router", "tcp://127.0.0.1:9")])
def test_non_loopback_bind_without_a_secret_is_refused(command: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KVWIRE_SECRET", "KVWIRE_API_KEY")}
    helped = subprocess.run(kvwire_argv(command[0], "--help"), capture_output=True, text=True, env=env,
                            timeout=120, check=False)
    if "--insecure" not in helped.stdout:  # never bind a public address where the refusal is missing
        pytest.fail(f"kvwire {command[0]} has no --insecure flag: the refusal is not implemented")
    done = subprocess.run(kvwire_argv(*command, "--host", "0.0.0.0"), capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode != 0
    assert "--insecure" in done.stderr  # the refusal says what to do
