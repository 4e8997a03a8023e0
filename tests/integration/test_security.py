"""Each attack of the threat model (docs/security.md) against a real cluster with an API key and a
shared secret (router + 1 prefill + 1 decode, tiny model, CPU): refused, counted in a metric,
logged once, and the cluster keeps serving. The transfer-level attack (a third agent attaching to a
transfer) is in test_transfer_binding.py; etcd records, a cluster without a secret and the router's
own refusals in test_security_discovery.py."""

from __future__ import annotations

import json
import select
import socket
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.discovery.heartbeats import Deregister, Heartbeat, InstanceInfo, encode_frames
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from kvwire.protocol.kv_signing import ParamsSigner
from support.pd_cluster_helpers import running_cluster
from support.waiting import wait_for

pytestmark = pytest.mark.slow
API_KEY = "sk-kvwire-test-key"
SECRET = "security-test-secret-0123456789abcdef"
PROMPT = [11, 12, 13, 14, 15, 16, 17]


def call(url: str, body: dict[str, Any] | None = None, key: str | None = API_KEY) -> tuple[int, Any]:
    """POST ``body`` (GET without one); returns (status, decoded JSON or text)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            **extra}


def metric(url: str, name: str, **labels: str) -> float:
    status, text = call(f"{url}/metrics")
    assert status == 200
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security") / "cluster.log"


@pytest.fixture(scope="module")
def cluster(log_path: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_prefill=1, num_decode=1, mode=TransferMode.PUSH, kv_deadline_s=5.0,
                       heartbeat_interval_s=0.5, api_key=API_KEY, secret=SECRET)
    with running_cluster(spec, log_path) as pd:
        yield pd


def _instance_url(cluster: LocalCluster, name: str) -> str:
    url = cluster.instances[name].url
    assert url is not None
    return url


def assert_serving(cluster: LocalCluster) -> None:
    """A request through the router succeeds, its KV moved from P to D (signed params accepted)."""
    decode = _instance_url(cluster, "decode-0")
    received = metric(decode, "kvwire_pd_transfers_completed_total", side="recv")
    status, answer = call(f"{cluster.router_url}/v1/completions", completion())
    assert status == 200, answer
    assert answer["choices"][0]["text"]
    assert metric(decode, "kvwire_pd_transfers_completed_total", side="recv") == received + 1
    assert metric(decode, "kvwire_pd_load_failures_total") == 0


def test_router_and_instances_require_api_keys(cluster: LocalCluster) -> None:
    router, prefill = cluster.router_url, _instance_url(cluster, "prefill-0")
    for url in (router, prefill):
        for key in (None, "sk-wrong-key-0000"):
            status, answer = call(f"{url}/v1/completions", completion(), key=key)
            assert status == 401, answer
            assert answer["error"]["reason"] == "invalid_api_key" and answer["error"]["code"] == 401
        assert call(f"{url}/metrics", key=None)[0] == 401
        assert call(f"{url}/health", key=None)[0] == 200  # probes need no key
    assert call(f"{router}/instances", key=None)[0] == 401
    assert metric(router, "kvwire_router_auth_refused_total", reason="missing_api_key") == 3
    assert metric(router, "kvwire_router_auth_refused_total", reason="wrong_api_key") == 1
    assert metric(prefill, "kvwire_refused_total", reason="missing_api_key") == 2
    assert_serving(cluster)  # the router's own key gets it into the instances


def test_forged_kv_transfer_params_are_refused_before_any_connection(
    cluster: LocalCluster, log_path: Path
) -> None:
    prefill = _instance_url(cluster, "prefill-0")
    trap = socket.socket()  # an address of the attacker's choosing: nobody may connect to it
    trap.bind(("127.0.0.1", 0))
    trap.listen()
    trap_endpoint = f"tcp://127.0.0.1:{trap.getsockname()[1]}"
    try:
        forged = KVTransferParams(transfer_id=uuid.uuid4().hex, role=Role.PREFILL,
                                  peer_endpoints=[trap_endpoint], peer_instance_id="decode-0")
        genuine = ParamsSigner(SECRET).sign(msgspec.structs.replace(forged, peer_endpoints=["tcp://x:1"]))
        tampered = msgspec.structs.replace(genuine, peer_endpoints=[trap_endpoint])
        stale = ParamsSigner(SECRET, clock=lambda: time.time() - 600).sign(forged)
        # a forged request is refused for its signature whatever else is wrong with it
        malformed = msgspec.structs.replace(genuine, peer_endpoints=["not an endpoint"])
        attempts = [("unsigned", forged), ("bad_signature", tampered), ("bad_signature", tampered),
                    ("bad_signature", tampered), ("bad_signature", malformed), ("expired", stale)]
        for reason, params in attempts:
            body = completion(kv_transfer_params=params.to_dict())
            status, answer = call(f"{prefill}/v1/completions", body)
            assert status == 403, answer
            assert answer["error"]["reason"] == reason and answer["error"]["code"] == 403
        # A genuine pull-mode prefill is admitted once; the same parameters again are a replay.
        lease = ParamsSigner(SECRET).sign(KVTransferParams(transfer_id=uuid.uuid4().hex,
                                                           mode=TransferMode.PULL, role=Role.PREFILL))
        assert call(f"{prefill}/v1/completions", completion(kv_transfer_params=lease.to_dict()))[0] == 200
        status, answer = call(f"{prefill}/v1/completions", completion(kv_transfer_params=lease.to_dict()))
        assert (status, answer["error"]["code"], answer["error"]["reason"]) == (403, 403, "replayed")

        assert_serving(cluster)  # the instances keep serving; and by now any connection would be in
        assert select.select([trap], [], [], 0)[0] == []
    finally:
        trap.close()
    counts = {r: metric(prefill, "kvwire_refused_total", reason=r)
              for r in ("unsigned", "bad_signature", "expired", "replayed")}
    assert counts == {"unsigned": 1, "bad_signature": 4, "expired": 1, "replayed": 1}
    logged = log_path.read_text().count("refused kv_transfer_params (bad_signature)")
    assert logged == 1  # once, not per attempt


def test_pull_mode_moves_kv_with_signed_params(tmp_path: Path) -> None:
    """Pull mode: P's answer is re-signed by the router for D (with P's registered endpoints)."""
    spec = ClusterSpec(num_prefill=1, num_decode=1, mode=TransferMode.PULL, kv_deadline_s=5.0,
                       heartbeat_interval_s=0.5, api_key=API_KEY, secret=SECRET)
    with running_cluster(spec, tmp_path / "pull.log") as pd:
        assert_serving(pd)


# --- discovery and identity (decision 125); these run after the counting test above -------------


def _trap() -> tuple[socket.socket, str]:
    """A listening socket at an address of the attacker's choosing: nobody may ever connect to it."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen()
    return trap, f"127.0.0.1:{trap.getsockname()[1]}"


def _push(address: str, messages: list[list[bytes]]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    for frames in messages:
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def _instances(router: str) -> dict[str, dict[str, Any]]:
    status, entries = call(f"{router}/instances")
    assert status == 200, entries
    return {entry["id"]: entry for entry in entries}


def _dropped(router: str, reason: str) -> float:
    return metric(router, "kvwire_router_discovery_dropped_total", reason=reason)


def test_health_shows_no_endpoints_without_a_key(cluster: LocalCluster) -> None:
    for name in ("prefill-0", "decode-0"):
        url = _instance_url(cluster, name)
        for key in (None, "sk-wrong-key-0000"):
            assert call(f"{url}/health", key=key) == (200, {"status": "ok"})  # probes: status only
        status, health = call(f"{url}/health")
        assert status == 200 and health["instance_id"] == name and len(health["kv_endpoints"]) == 1


def test_fake_registration_without_the_secret_is_dropped(cluster: LocalCluster, log_path: Path) -> None:
    """Heartbeats unsigned or signed with another secret, one of them claiming decode-0's URL (which
    would evict it): dropped and counted; the registry and the traffic are untouched."""
    router = cluster.router_url
    trap, trap_address = _trap()
    decode_url = _instance_url(cluster, "decode-0")
    before = _dropped(router, "unauthenticated")
    try:
        fakes = [InstanceInfo(instance_id="intruder", role=Role.DECODE, url=f"http://{trap_address}",
                              model="tiny", kv_endpoints=[f"tcp://{trap_address}"]),
                 InstanceInfo(instance_id="usurper", role=Role.DECODE, url=decode_url, model="tiny")]
        messages = [encode_frames(Heartbeat(info=info, seq=1, sent_at=time.time()), secret)
                    for info in fakes for secret in (None, b"not-the-cluster-secret")]
        _push(cluster.discovery_address, messages)
        wait_for(lambda: _dropped(router, "unauthenticated") >= before + 4, 30.0, "fake heartbeats dropped",
                 interval_s=0.1)
        entries = _instances(router)
        assert set(entries) == {"prefill-0", "decode-0"} and all(e["alive"] for e in entries.values())
        assert_serving(cluster)
        assert select.select([trap], [], [], 0)[0] == []
    finally:
        trap.close()
    assert log_path.read_text().count("refused discovery message (unauthenticated)") == 1


def test_replayed_heartbeat_is_refused(cluster: LocalCluster, log_path: Path) -> None:
    """A heartbeat signed with the secret, captured and sent again: after its instance deregistered
    (the registry alone would take it back), and an early one of a live instance (decode-0)."""
    router = cluster.router_url
    trap, trap_address = _trap()
    before = _dropped(router, "replayed")
    try:
        ghost = InstanceInfo(instance_id="ghost", role=Role.DECODE, url=f"http://{trap_address}",
                             model="tiny-ghost")  # another model: no request is routed to it meanwhile
        captured = encode_frames(Heartbeat(info=ghost, seq=1, sent_at=time.time()), SECRET.encode())
        _push(cluster.discovery_address, [captured])
        wait_for(lambda: "ghost" in _instances(router), 30.0, "the genuine heartbeat registers")
        bye = Deregister(instance_id="ghost", epoch=ghost.epoch, seq=2, sent_at=time.time())
        _push(cluster.discovery_address, [encode_frames(bye, SECRET.encode())])
        wait_for(lambda: "ghost" not in _instances(router), 30.0, "ghost deregistered")

        decode = _instances(router)["decode-0"]
        early = InstanceInfo(instance_id="decode-0", role=Role.DECODE, url=decode["url"], model="tiny",
                             epoch=decode["epoch"], kv_endpoints=[f"tcp://{trap_address}"])
        replayed_early = encode_frames(Heartbeat(info=early, seq=1, sent_at=time.time()), SECRET.encode())
        _push(cluster.discovery_address, [captured, captured, replayed_early])
        wait_for(lambda: _dropped(router, "replayed") >= before + 3, 30.0, "replays dropped", interval_s=0.1)
        entries = _instances(router)
        assert "ghost" not in entries and entries["decode-0"]["kv_endpoints"] != early.kv_endpoints
        assert_serving(cluster)
        assert select.select([trap], [], [], 0)[0] == []
    finally:
        trap.close()
    assert log_path.read_text().count("refused discovery message (replayed)") == 1
