"""An instance killed (SIGKILL) while it serves a request: the client never notices (decision 052).

Real processes, tiny model on CPU. Streaming: the router continues the answer on a live instance
(prompt + tokens already streamed) inside the same SSE stream; greedy output equals an uninterrupted
run token for token. Non-streaming: re-dispatched invisibly. Nothing left alive: a clear error.
The survivors (router and instances) return to their thread / fd / shared-memory counts of before
the kill (tests/support/leaks.py), once every instance had served, so first-use threads and P's
links to each decode instance are in the baseline.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.cluster.process import wait_until
from support.fault_cluster import (
    StreamKiller,
    blocks_back_to_zero,
    completion,
    http_ports,
    live_urls,
    metric,
    pids,
    post_json,
    running,
    serving,
)
from support.leaks import LeakBaseline
from support.sse_client import SSEResult, stream

pytestmark = pytest.mark.slow
MAX_TOKENS = 200
KILL_AFTER = 4  # content events the client has seen when the serving instance is killed


def _spec(**kw: Any) -> ClusterSpec:
    return ClusterSpec(heartbeat_interval_s=0.5, instance_ttl_s=2.0, kv_deadline_s=3.0, **kw)


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = _spec(num_prefill=0, num_decode=0, num_both=2)
    with running(spec, tmp_path_factory.mktemp("mig") / "both.log") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running(_spec(num_prefill=1, num_decode=2), tmp_path_factory.mktemp("mig") / "pd.log") as cluster:
        yield cluster


def sigkill_serving(cluster: LocalCluster, role: str) -> StreamKiller:
    """SIGKILLs the instance of ``role`` serving the stream once ``KILL_AFTER`` content events came."""
    return StreamKiller(cluster, role, lambda name: cluster.kill(name, signal.SIGKILL), KILL_AFTER)


def _warm_baseline(cluster: LocalCluster, role: str) -> LeakBaseline:
    """Requests through the router until every live instance of ``role`` has served one (bounded),
    then the survivors' leak baseline."""
    served = "kvwire_requests_total"
    attempt = iter(range(1, 1000))

    def everyone_served() -> bool:  # prompts with no common block: the policy balances, no affinity
        prompt = [next(attempt) % 250 + 1] * 20
        body = completion(4, stream=False, prompt=prompt)
        status, _ = post_json(cluster.router_url + "/v1/completions", body)
        assert status == 200
        return all(metric(url, served) > 0 for url in live_urls(cluster, role).values())

    assert wait_until(everyone_served, 60, interval_s=0.0), f"not every {role} instance served"
    assert blocks_back_to_zero(cluster, 10)
    return LeakBaseline.take(pids(cluster), pooled_ports=http_ports(cluster))


def _restart(cluster: LocalCluster, name: str) -> None:
    role = cluster.instances[name].role
    del cluster.instances[name]
    cluster.start_instance(name + "r", role)
    cluster.wait_ready()


def _check_same(got: SSEResult, ref: SSEResult) -> None:
    assert got.status == 200 and got.error is None and not got.errors, (got.error, got.errors)
    assert got.done
    assert got.token_ids() == ref.token_ids()
    assert got.text() == ref.text()
    assert len(got.ids()) == 1  # one response id throughout


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_survives_its_instance_dying(both: LocalCluster, path: str) -> None:
    body = completion(MAX_TOKENS, stream=True)
    if path.endswith("chat/completions"):
        body = {k: v for k, v in body.items() if k != "prompt"}
        body["messages"] = [{"role": "user", "content": "tell me a long story"}]
        body["stream_options"] = {"include_usage": True}
    ref = stream(both.router_url, path, body)
    assert len(ref.token_ids()) == MAX_TOKENS
    baseline = _warm_baseline(both, "both")
    killer = sigkill_serving(both, "both")
    got = stream(both.router_url, path, body, on_event=killer)
    assert killer.killed is not None, "the stream ended before an instance could be killed"
    _check_same(got, ref)
    if path.endswith("chat/completions"):
        usage = [e["usage"] for e in got.events if isinstance(e, dict) and e.get("usage")]
        ref_usage = [e["usage"] for e in ref.events if isinstance(e, dict) and e.get("usage")]
        assert usage == ref_usage and usage[0]["completion_tokens"] == MAX_TOKENS
    assert blocks_back_to_zero(both, 10)
    baseline.without(killer.killed).wait_back(15)
    _restart(both, killer.killed)


def test_pd_stream_survives_its_decode_instance_dying(pd: LocalCluster) -> None:
    body = completion(MAX_TOKENS, stream=True)
    ref = stream(pd.router_url, "/v1/completions", body)
    baseline = _warm_baseline(pd, "decode")
    killer = sigkill_serving(pd, "decode")
    got = stream(pd.router_url, "/v1/completions", body, on_event=killer)
    assert killer.killed is not None
    _check_same(got, ref)
    assert blocks_back_to_zero(pd, 10)
    baseline.without(killer.killed).wait_back(15)
    _restart(pd, killer.killed)


def test_non_streaming_request_is_redispatched(pd: LocalCluster) -> None:
    body = completion(MAX_TOKENS, stream=False)
    status, ref = post_json(pd.router_url + "/v1/completions", body)
    assert status == 200
    baseline = _warm_baseline(pd, "decode")
    result: list[tuple[int, Any]] = []
    url = pd.router_url + "/v1/completions"
    thread = threading.Thread(target=lambda: result.append(post_json(url, body)), daemon=True)
    thread.start()
    victim: list[str] = []

    def kill_serving() -> bool:
        name = serving(pd, "decode")
        if name is not None:
            pd.kill(name, signal.SIGKILL)
            victim.append(name)
        return bool(victim)

    assert wait_until(kill_serving, 30, interval_s=0.02), "no decode instance was seen serving"
    thread.join(60)
    status, got = result[0]
    assert status == 200, got
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert blocks_back_to_zero(pd, 10)
    baseline.without(victim[0]).wait_back(15)
    _restart(pd, victim[0])


def test_clear_error_when_no_instance_is_left(tmp_path: Path) -> None:
    with running(_spec(num_prefill=0, num_decode=0, num_both=1), tmp_path / "one.log") as cluster:
        baseline = _warm_baseline(cluster, "both")
        killer = sigkill_serving(cluster, "both")
        got = stream(cluster.router_url, "/v1/completions", completion(MAX_TOKENS, stream=True),
                     on_event=killer)
        assert killer.killed is not None
        assert got.status == 200 and got.done, got.events[-3:]
        assert len(got.errors) == 1 and "failed mid-stream" in got.errors[0]["error"]["message"]
        baseline.without(killer.killed).wait_back(15)  # the router alone survives: back to its counts
