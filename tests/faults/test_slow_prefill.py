"""A P that is alive but runs a small fraction of the time keeps P/D (decision 123).

Real router + 1P1D ``kvwire serve`` processes, ``--kv-deadline-s 1``; a thread stops and continues P's
process group in a duty cycle (running ``RUN_S`` of every ``PERIOD_S``) while 40 requests are sent at
concurrency 20. Goal: 0 failed and 0 recomputed (D's ``kvwire_pd_load_failures_total``): D's lease
covers the request from the moment the router dispatched it to P, not only once P's engine promised it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from support.fault_cluster import completion, metric, running

pytestmark = pytest.mark.slow
PERIOD_S = 0.5
RUN_S = 0.05  # P runs 10 % of the time, stopped 0.45 s at a time (nearly half the lease)
REQUESTS, CONCURRENCY = 40, 20


class DutyCycle:
    """Stops and continues one instance's process group until :meth:`stop` (which leaves it running)."""

    def __init__(self, cluster: LocalCluster, name: str) -> None:
        self._process = cluster.instances[name].process
        self._stop = threading.Event()
        self.cycles = 0
        self._thread = threading.Thread(target=self._run, name=f"duty-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(RUN_S):
                self._process.signal(signal.SIGSTOP)
                self._stop.wait(PERIOD_S - RUN_S)
                self._process.signal(signal.SIGCONT)
                self.cycles += 1
        finally:
            self._process.signal(signal.SIGCONT)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def send_all(url: str, bodies: list[dict[str, Any]]) -> list[RequestResult]:
    async def run() -> list[RequestResult]:
        async with aiohttp.ClientSession() as session:
            calls = [post_completion(session, f"{url}/v1/completions", b, timeout_s=300) for b in bodies]
            return list(await asyncio.gather(*calls))

    return asyncio.run(run())


def test_slow_prefill_keeps_pd_with_a_one_second_lease(tmp_path: Path) -> None:
    spec = ClusterSpec(num_prefill=1, num_decode=1, kv_deadline_s=1.0,
                       router_args=("--policy", "round_robin", "--upstream-timeout-s", "300"))
    with running(spec, tmp_path / "cluster.log") as cluster:
        url = cluster.router_url
        d_url = next(i.url for i in cluster.live_instances() if i.role == "decode")
        assert d_url is not None
        prompts = [[(7 * j + 13 * i) % 250 + 1 for j in range(48 + i)] for i in range(REQUESTS)]
        duty = DutyCycle(cluster, "prefill-0")
        results = []
        try:
            for start in range(0, REQUESTS, CONCURRENCY):
                batch = [completion(4, stream=False, prompt=p) for p in prompts[start:start + CONCURRENCY]]
                results += send_all(url, batch)
        finally:
            duty.stop()
        failed = [r.error for r in results if not r.ok]
        recomputed = metric(d_url, "kvwire_pd_load_failures_total")
        print(f"duty cycles {duty.cycles}; failed {len(failed)}; recomputed {recomputed:.0f}")
        assert duty.cycles > 0
        assert failed == []
        assert recomputed == 0
