"""SIGSTOP of an instance for longer than the heartbeat TTL, then SIGCONT (decision 052).

The router abandons a read from an instance that stopped heartbeating (its entry expired) and
migrates the stream; the client sees one complete, uninterrupted answer long before the upstream
timeout. The stopped instance, continued, aborts the orphaned request (no double completion), frees
its blocks and serves again once it re-registers; both instances and the router return to their
thread / fd / shared-memory counts (tests/support/leaks.py).
"""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.cluster.process import wait_until
from support.fault_cluster import (
    blocks_back_to_zero,
    completion,
    http_ports,
    live_urls,
    pids,
    post_json,
    running,
    serving,
)
from support.leaks import LeakBaseline
from support.sse_client import stream

pytestmark = pytest.mark.slow
MAX_TOKENS = 200
TTL_S = 2.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_prefill=0, num_decode=0, num_both=2, heartbeat_interval_s=0.5,
                       instance_ttl_s=TTL_S)
    with running(spec, Path(tmp_path_factory.mktemp("stop")) / "stop.log") as cluster:
        yield cluster


def test_stopped_instance_mid_stream_is_migrated_then_recovers(pair: LocalCluster) -> None:
    body = completion(MAX_TOKENS, stream=True)
    ref = stream(pair.router_url, "/v1/completions", body)
    for url in live_urls(pair).values():  # warm both the same way before the counts are taken
        assert post_json(url + "/v1/completions", completion(8, stream=False))[0] == 200
    baseline = LeakBaseline.take(pids(pair), pooled_ports=http_ports(pair))
    stopped: list[str] = []

    def stop_serving(event: object) -> None:
        if not stopped and isinstance(event, dict) and event.get("choices"):
            name = serving(pair, "both")
            if name is not None:
                pair.instances[name].process.signal(signal.SIGSTOP)
                stopped.append(name)

    got = stream(pair.router_url, "/v1/completions", body, on_event=stop_serving, timeout_s=60)
    assert stopped, "no instance was stopped"
    try:
        assert got.error is None and not got.errors and got.done
        assert got.token_ids() == ref.token_ids() and len(got.ids()) == 1
        assert got.elapsed_s < TTL_S + 15  # abandoned at expiry, not at the 600 s upstream timeout
    finally:
        pair.instances[stopped[0]].process.signal(signal.SIGCONT)
    name = stopped[0]
    url = live_urls(pair)[name]
    assert wait_until(lambda: any(e["id"] == name and e["alive"] for e in
                                  get_json_list(pair.router_url + "/instances")), 20, interval_s=0.2)
    assert blocks_back_to_zero(pair, 15)  # the orphaned request was aborted, its blocks freed
    status, answer = post_json(url + "/v1/completions", completion(8, stream=False))
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == 8  # it serves again
    baseline.wait_back(15)


def get_json_list(url: str) -> list[dict[str, object]]:
    """GET a JSON list (the router's /instances)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        data = json.loads(resp.read())
    assert isinstance(data, list)
    return data
