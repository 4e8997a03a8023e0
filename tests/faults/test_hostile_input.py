"""Malformed and hostile input against a running 1P1D cluster: fuzzed msgpack and truncated frames on
P's and D's transfer control ports, garbage and forged heartbeats on the router's discovery port, raw
bytes on both, oversized and malformed HTTP bodies on router and instances. Each is refused (and
counted where the issue asks); afterwards every process still serves P/D requests exactly, no KV
block is left in use, and router, P and D are back to their thread / fd / shared-memory counts
(tests/support/leaks.py)."""

from __future__ import annotations

import json
import random
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.discovery.heartbeats import Heartbeat, InstanceInfo, encode_frames
from kvwire.protocol.kv_params import Role
from kvwire.transfer.wire import PROTOCOL_VERSION
from support.fault_cluster import (
    blocks_back_to_zero,
    completion,
    http_ports,
    metric,
    pids,
    post_json,
    running,
)
from support.leaks import LeakBaseline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(heartbeat_interval_s=0.5, instance_ttl_s=2.0, kv_deadline_s=3.0)
    with running(spec, Path(tmp_path_factory.mktemp("hostile")) / "hostile.log") as c:
        yield c


@pytest.fixture(scope="module")
def baseline(cluster: LocalCluster) -> LeakBaseline:
    _pd_works(cluster)  # warm: the paths every test uses exist before the counts are taken
    return LeakBaseline.take(pids(cluster), pooled_ports=http_ports(cluster))


def _instances(cluster: LocalCluster) -> list[dict[str, Any]]:
    with urllib.request.urlopen(cluster.router_url + "/instances", timeout=5) as resp:
        data: list[dict[str, Any]] = json.loads(resp.read())
    return data


def _pd_works(cluster: LocalCluster) -> list[int]:
    status, answer = post_json(cluster.router_url + "/v1/completions", completion(8, stream=False))
    assert status == 200, answer
    ids: list[int] = answer["choices"][0]["token_ids"]
    assert len(ids) == 8
    return ids


def _fuzz_frames(rng: random.Random) -> list[list[bytes]]:
    enc = msgspec.msgpack.encode
    good = {"t": "offer", "v": PROTOCOL_VERSION, "src_id": "x", "src_endpoint": "tcp://127.0.0.1:9",
            "transfer_id": "t", "layers": [[[1, 2], "float16"]], "deadline_s": 1.0, "data_address": "a:1"}
    cases: list[list[bytes]] = [
        [b""], [b"\x00" * 7], [enc(good)[:9]], [enc({"t": "nope", "v": PROTOCOL_VERSION})],
        [enc(dict(good, v=99))], [enc(dict(good, deadline_s=-1))], [enc(dict(good, layers=[[[-1], "x"]]))],
        [enc(dict(good, t="ack", layers=[-5]))], [enc(good), b"bad-mac", b"extra"],
        [enc(dict(good, t="renew", state="x" * 1000))], [enc(dict(good, src_endpoint="http://evil"))],
        [enc(dict(good, t="abort", reason="r", transfer_id="z" * 5000))],
    ]
    cases += [[bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))] for _ in range(40)]
    return cases


def test_fuzzed_control_messages_are_refused_and_counted(cluster: LocalCluster,
                                                        baseline: LeakBaseline) -> None:
    reference = _pd_works(cluster)
    rng = random.Random(7)
    ctx = zmq.Context()
    try:
        for entry in _instances(cluster):
            url = entry["url"]
            before = metric(url, "kvwire_pd_control_messages_rejected")
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 500)
            sock.connect(entry["kv_endpoints"][0])
            cases = _fuzz_frames(rng)
            for frames in cases:
                sock.send_multipart(frames)
            sock.close()
            deadline_ok = _poll(lambda u=url, b=before, n=len(cases):
                                metric(u, "kvwire_pd_control_messages_rejected") >= b + n)
            assert deadline_ok, f"{entry['id']}: not every malformed message was counted"
            host, port = entry["kv_endpoints"][0].removeprefix("tcp://").split(":")
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(bytes(rng.randrange(256) for _ in range(4096)))  # not even ZMTP
    finally:
        ctx.term()
    assert _pd_works(cluster) == reference
    assert blocks_back_to_zero(cluster, 10)
    baseline.wait_back(15)


def test_garbage_and_forged_heartbeats_change_nothing(cluster: LocalCluster, baseline: LeakBaseline) -> None:
    before_ids = {e["id"]: (e["url"], e["alive"]) for e in _instances(cluster)}
    dropped = metric(cluster.router_url, "kvwire_router_discovery_dropped_total")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(cluster.discovery_address)
        for frames in ([b"junk"], [b"\x81\xa1t\xa9heartbeat", b""], [b"x" * 70_000, b""]):
            sock.send_multipart(frames)
        # a stale epoch of a live instance, pointing its traffic elsewhere: refused as a zombie
        victim = next(iter(before_ids))
        forged = InstanceInfo(instance_id=victim, role=Role.DECODE, url="http://127.0.0.1:9",
                              model="tiny", epoch=1)
        sock.send_multipart(encode_frames(Heartbeat(info=forged, seq=10**9)))
        sock.close()
    finally:
        ctx.term()
    host, port = cluster.discovery_address.removeprefix("tcp://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
    assert _poll(lambda: metric(cluster.router_url, "kvwire_router_discovery_dropped_total") >= dropped + 3)
    after = {e["id"]: (e["url"], e["alive"]) for e in _instances(cluster)}
    assert after == before_ids
    _pd_works(cluster)
    baseline.wait_back(15)


@pytest.mark.parametrize("target", ["router", "instance"])
def test_malformed_and_oversized_http_bodies_get_4xx(cluster: LocalCluster, baseline: LeakBaseline,
                                                     target: str) -> None:
    url = cluster.router_url if target == "router" else _instances(cluster)[0]["url"]
    cases = [(b"{not json", 400), (b"[1, 2]", 400), (b'{"prompt": 5, "max_tokens": -1}', 400),
             (b'{"model": "tiny", "prompt": [1], "max_tokens": 1, "stream": "yes"}', 400),
             (b"x" * (17 * 1024 * 1024), 413)]
    for body, want in cases:
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, text = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read()
        assert status == want, (body[:40], status, text[:200])
        assert "error" in json.loads(text)  # a JSON error body, OpenAI style
    _pd_works(cluster)
    baseline.wait_back(15)


def _poll(cond: Any, timeout_s: float = 10.0) -> bool:
    from kvwire.cluster.process import wait_until

    return wait_until(cond, timeout_s, interval_s=0.1)
