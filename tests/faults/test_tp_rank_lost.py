"""One tensor-parallel rank of a decode instance killed (SIGKILL) while it streams an answer
(decision 085). Real processes, tiny model on CPU: 1 P (TP 1) and 2 D (TP 2) behind the router.

The instance finds the dead rank within a step, fails its in-flight request with 503
``instance_lost`` (in-band: the stream had started), deregisters and exits with code 3; the router
continues the stream on the other D, token for token as an uninterrupted run; the survivors hold no
blocks afterwards and serve new requests; the cluster restarts the instance (what `kvwire up` does).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster, http_json
from kvwire.cluster.process import wait_until
from kvwire.errors import EXIT_RANK_LOST
from support.fault_cluster import (
    StreamKiller,
    blocks_back_to_zero,
    completion,
    live_urls,
    post_json,
    running,
)
from support.sse_client import stream

pytestmark = pytest.mark.slow
MAX_TOKENS = 120
KILL_AFTER = 4  # content events the client has seen when the rank is killed


def tp_workers(pid: int) -> list[int]:
    """The tensor-parallel worker processes under the instance ``pid`` (spawned descendants)."""
    workers, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = []  # per thread: the engine is built on an executor thread, which spawns them
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children += [int(c) for c in f.read().split()]
            for child in children:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        workers.append(child)
        except FileNotFoundError:  # exited meanwhile
            continue
        todo += children
    return workers


def kill_serving_rank(cluster: LocalCluster) -> StreamKiller:
    """Once ``KILL_AFTER`` content events came: SIGKILL rank 1 of the decode instance serving."""

    def kill_rank(name: str) -> None:
        process = cluster.instances[name].process
        (worker,) = tp_workers(process.pid)
        process.expected_exit = True  # it exits by itself (code 3): not a cluster failure
        os.kill(worker, signal.SIGKILL)

    return StreamKiller(cluster, "decode", kill_rank, KILL_AFTER)


def test_a_decode_rank_killed_mid_stream(tmp_path: Path) -> None:
    spec = ClusterSpec(num_prefill=1, num_decode=2, decode_tp=2, heartbeat_interval_s=0.5, instance_ttl_s=2.0,
                       kv_deadline_s=3.0)  # fmt: skip
    with running(spec, tmp_path / "cluster.log") as cluster:
        body = completion(MAX_TOKENS, stream=True)
        ref = stream(cluster.router_url, "/v1/completions", body)
        assert len(ref.token_ids()) == MAX_TOKENS
        killer = kill_serving_rank(cluster)
        got = stream(cluster.router_url, "/v1/completions", body, on_event=killer)
        assert killer.killed is not None, "the stream ended before a rank could be killed"
        assert got.status == 200 and got.error is None and not got.errors, (got.error, got.errors)
        assert got.done and got.token_ids() == ref.token_ids() and got.text() == ref.text()
        # The instance stops by itself, within a bound, with the rank-lost exit code.
        process = cluster.instances[killer.killed].process
        assert wait_until(lambda: process.poll() is not None, 30, interval_s=0.1), "the instance did not stop"
        assert process.poll() == EXIT_RANK_LOST
        assert time.monotonic() - killer.killed_at < 30
        assert "lost a tensor-parallel rank" in "\n".join(process.lines)
        listed = http_json(f"{cluster.router_url}/instances")
        assert not any(e["id"] == killer.killed and e.get("alive") for e in listed), listed
        # Survivors hold nothing and keep serving.
        assert blocks_back_to_zero(cluster, 10)
        assert len(live_urls(cluster, "decode")) == 1
        status, answer = post_json(cluster.router_url + "/v1/completions", completion(8, stream=False))
        assert status == 200 and answer["choices"][0]["token_ids"] == ref.token_ids()[:8], answer
        # What `kvwire up` does next: the instance comes back under its name, with all its ranks.
        assert cluster.restart_if_rank_lost(killer.killed)
        assert not cluster.restart_if_rank_lost(killer.killed)  # running again: nothing to restart
        cluster.wait_ready(120)
        assert len(live_urls(cluster, "decode")) == 2
