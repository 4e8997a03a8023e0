"""`kvwire up --prefill-tp 1 --decode-tp 2`: the router pairs instances of different TP sizes, every
rank's endpoint and the KV layout are advertised, and greedy output equals a colocated TP=1 instance."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, http_json
from support.pd_cluster_helpers import ColocatedServer, body, metric, prompts, running_cluster, send_all
from support.waiting import wait_for

pytestmark = pytest.mark.slow


def test_prefill_tp1_decode_tp2_through_the_router(tmp_path: Path) -> None:
    bodies = [body(p, stream=(i % 2 == 1)) for i, p in enumerate(prompts(8))]
    with open(tmp_path / "reference.log", "w") as sink:
        server = ColocatedServer(sink)
        try:
            reference = send_all(server.url, bodies)
        finally:
            server.stop()
    spec = ClusterSpec(num_prefill=1, num_decode=1, decode_tp=2, kv_deadline_s=10.0, heartbeat_interval_s=0.5)
    with running_cluster(spec, tmp_path / "cluster.log") as cluster:
        listed = {i["role"]: i for i in http_json(f"{cluster.router_url}/instances")}
        assert len(listed["decode"]["kv_endpoints"]) == 2 and len(listed["prefill"]["kv_endpoints"]) == 1
        assert [listed[r]["kv_layout"]["tp_size"] for r in ("prefill", "decode")] == [1, 2]
        results = send_all(cluster.router_url, bodies)
        for i, (got, want) in enumerate(zip(results, reference, strict=True)):
            assert got.ok and got.token_ids == want.token_ids, (i, got.error)
        for inst in cluster.live_instances():
            assert inst.url is not None
            wait_for(lambda u=inst.url: metric(u, "kvwire_kv_blocks_in_use") == 0
                     and metric(u, "kvwire_pd_blocks_awaiting_send") == 0, 15.0, f"{inst.name} holds blocks")
            assert metric(inst.url, "kvwire_pd_load_failures_total") == 0
