"""P/D fault injection with real processes: a peer is frozen (SIGSTOP) so the handover is surely in
flight, then killed (SIGKILL). Nothing hangs; blocks are released within the KV deadline; D applies
its load-failure policy (recompute: exact output; fail: a clear error); the survivors (the other
instance and the router) return to their thread / fd / shared-memory counts of before the fault,
taken after one P/D request, so the P<->D link is in the baseline (tests/support/leaks.py)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.client import RequestResult
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from support.leaks import LeakBaseline
from support.pd_cluster_helpers import body, metric, running_cluster, send_all
from support.waiting import wait_for

pytestmark = pytest.mark.slow
DEADLINE_S = 3.0
SLACK_S = 12.0  # scheduling noise on a loaded 2-core box (process kill, polling, heartbeats)
PROMPT = [(5 * j) % 250 + 1 for j in range(3 * 16 + 5)]


@pytest.fixture(scope="module")
def expected() -> list[int]:
    engine = LLMEngine(EngineConfig(model="tiny"))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            tokens = out.token_ids
    engine.close()
    return tokens


def make_cluster(tmp: Path, policy: str) -> Iterator[LocalCluster]:
    # round_robin: these faults need P in the path; the default (kv_aware) would serve a prompt D
    # already holds without P. Policy fail: --pd-fallback error, so that the router does not
    # re-dispatch the failed request to D alone once P is gone (decision 124) and D's error is what
    # the client sees.
    fallback = ("--pd-fallback", "error") if policy == "fail" else ()
    spec = ClusterSpec(num_prefill=1, num_decode=1, kv_deadline_s=DEADLINE_S, kv_load_failure_policy=policy,
                       heartbeat_interval_s=0.5, instance_ttl_s=2.0,
                       router_args=("--policy", "round_robin", *fallback))
    with running_cluster(spec, tmp / f"faults-{policy}.log") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def recompute_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from make_cluster(tmp_path_factory.mktemp("faults"), "recompute")


@pytest.fixture(scope="module")
def fail_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from make_cluster(tmp_path_factory.mktemp("faults"), "fail")


class Background:
    """One request sent from a thread; ``result`` once it returns."""

    def __init__(self, url: str) -> None:
        self.result: RequestResult | None = None
        self.started = time.monotonic()
        self.elapsed_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        self.result = send_all(url, [body(PROMPT, stream=False)], timeout_s=60)[0]
        self.elapsed_s = time.monotonic() - self.started

    def join(self, timeout_s: float) -> RequestResult:
        self._thread.join(timeout_s)
        assert self.result is not None, f"request still pending after {timeout_s} s"
        return self.result


def url_of(cluster: LocalCluster, name: str) -> str:
    url = cluster.instances[name].url
    assert url is not None
    return url


def warm_baseline(cluster: LocalCluster, survivor: str) -> LeakBaseline:
    """One P/D request through the router, then the leak baseline of ``survivor`` and the router."""
    warm = Background(cluster.router_url).join(60)
    assert warm.ok, warm.error
    assert cluster.router is not None
    pids = {survivor: cluster.instances[survivor].process.pid, "router": cluster.router.pid}
    ports = [url_of(cluster, survivor), cluster.router_url]
    return LeakBaseline.take(pids, pooled_ports=frozenset(int(u.rsplit(":", 1)[1]) for u in ports))


def kill_p_mid_handover(cluster: LocalCluster) -> Background:
    """Freeze P, send a request, wait until D expects the KV, then kill P."""
    d_url = url_of(cluster, "decode-0")
    started = metric(d_url, "kvwire_pd_transfers_started_total")
    cluster.instances["prefill-0"].process.signal(signal.SIGSTOP)
    request = Background(cluster.router_url)
    wait_for(lambda: metric(d_url, "kvwire_pd_transfers_started_total") > started, 20, "D expecting the KV")
    cluster.kill("prefill-0", signal.SIGKILL)
    return request


def test_p_killed_d_recomputes_exact_output(recompute_cluster: LocalCluster, expected: list[int]) -> None:
    d_url = url_of(recompute_cluster, "decode-0")
    baseline = warm_baseline(recompute_cluster, "decode-0")
    request = kill_p_mid_handover(recompute_cluster)
    result = request.join(DEADLINE_S + SLACK_S)
    assert result.ok, result.error
    assert result.token_ids == expected  # recomputed on D, token for token
    assert request.elapsed_s < DEADLINE_S + SLACK_S
    assert metric(d_url, "kvwire_pd_load_failures_total") >= 1
    wait_for(lambda: metric(d_url, "kvwire_kv_blocks_in_use") == 0, 10, "D frees its blocks")
    baseline.wait_back(15)


def test_d_killed_p_frees_blocks_within_deadline(recompute_cluster: LocalCluster) -> None:
    cluster = recompute_cluster
    cluster.start_instance("prefill-1", "prefill")  # the previous P was killed above
    cluster.wait_ready(60)
    p_url = url_of(cluster, "prefill-1")
    baseline = warm_baseline(cluster, "prefill-1")
    cluster.instances["decode-0"].process.signal(signal.SIGSTOP)
    request = Background(cluster.router_url)
    # P computed the prompt and holds its blocks for the (frozen) D.
    wait_for(lambda: metric(p_url, "kvwire_pd_blocks_awaiting_send") > 0, 20, "P holding blocks for D")
    assert metric(p_url, "kvwire_kv_blocks_in_use") > 0
    cluster.kill("decode-0", signal.SIGKILL)
    freed_after_s = wait_for(lambda: metric(p_url, "kvwire_kv_blocks_in_use") == 0, DEADLINE_S + SLACK_S,
                             "P frees its blocks after D died")
    assert freed_after_s < DEADLINE_S + SLACK_S
    assert metric(p_url, "kvwire_pd_blocks_awaiting_send") == 0
    assert metric(p_url, "kvwire_pd_transfers_failed_total") >= 1
    result = request.join(DEADLINE_S + SLACK_S)  # the client is answered (an error), never left hanging
    assert not result.ok and result.error
    baseline.wait_back(15)


def test_p_killed_policy_fail_gives_clear_error(fail_cluster: LocalCluster) -> None:
    baseline = warm_baseline(fail_cluster, "decode-0")
    request = kill_p_mid_handover(fail_cluster)
    result = request.join(DEADLINE_S + SLACK_S)
    assert not result.ok
    assert "remote KV load failed" in (result.error or ""), result.error
    d_url = url_of(fail_cluster, "decode-0")
    wait_for(lambda: metric(d_url, "kvwire_kv_blocks_in_use") == 0, 10, "D frees its blocks")
    baseline.wait_back(15)
    # D keeps serving: with P gone the router has no P/D pair, so nothing else to check here.
