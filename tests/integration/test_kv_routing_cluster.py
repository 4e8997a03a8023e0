"""KV-aware routing end to end: router (``--policy kv_aware``) + 1P1D ``kvwire serve`` processes.

A three-turn conversation: turn 2 adds few tokens to what D holds (the router skips P, D prefills the
rest locally), turn 3 adds many (P sends only the blocks D lacks). Every turn equals a colocated
instance token for token; the KV events reach the router's index (``/instances``) and the counters
say what happened.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, http_json
from support.pd_cluster_helpers import BLOCK, ColocatedServer, body, metric, running_cluster, send_all
from support.waiting import wait_for

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 1 for j in range(n)]


def d_cached_blocks(router_url: str) -> int:
    listed = http_json(f"{router_url}/instances")
    return sum(i["kv_cache"]["cached_blocks"] for i in listed if i["role"] == "decode")


def test_conversation_skips_prefill_then_sends_a_partial_transfer(tmp_path: Path) -> None:
    spec = ClusterSpec(num_prefill=1, num_decode=1, heartbeat_interval_s=0.5, kv_deadline_s=10.0,
                       router_args=("--policy", "kv_aware", "--decode-local-prefill-tokens", "64"))
    turns: list[list[int]] = []
    outputs: list[list[int]] = []
    with running_cluster(spec, tmp_path / "cluster.log") as cluster:
        url = cluster.router_url
        prompt = tokens(200, 1)
        for k, new in enumerate((0, 40, 300)):  # turn 2: 48 new tokens < 64; turn 3: 308 new tokens
            if k:
                prompt = prompt + outputs[-1] + tokens(new, k + 1)
                need = (len(turns[-1]) + MAX_TOKENS) // BLOCK - 1  # D caches the turn and its answer
                wait_for(lambda n=need: d_cached_blocks(url) >= n, 10.0, "D's KV events at the router")
            (result,) = send_all(url, [body(prompt, stream=k == 1, max_tokens=MAX_TOKENS)])
            assert result.ok, result.error
            turns.append(prompt)
            outputs.append(result.token_ids)
            if k == 1:
                assert metric(url, "kvwire_router_skipped_prefills_total") == 1
            if k == 2:
                assert metric(url, "kvwire_router_partial_transfers_total") == 1
        decode = next(i for i in cluster.live_instances() if i.role == "decode")
        assert decode.url is not None
        assert metric(decode.url, "kvwire_pd_partial_transfers_total") == 1  # recv/started, no miss
        assert metric(decode.url, "kvwire_pd_load_failures_total") == 0
        listed = {i["role"]: i for i in http_json(f"{url}/instances")}
        assert listed["decode"]["kv_cache"]["block_size"] == BLOCK
        assert listed["decode"]["kv_cache"]["hit_rate"] > 0.3
    with open(tmp_path / "reference.log", "w") as sink:
        server = ColocatedServer(sink)
        try:
            for prompt, expected in zip(turns, outputs, strict=True):
                (ref,) = send_all(server.url, [body(prompt, stream=False, max_tokens=MAX_TOKENS)])
                assert ref.ok and ref.token_ids == expected
        finally:
            server.stop()


def test_a_restarted_router_rebuilds_its_index_from_the_instances(tmp_path: Path) -> None:
    """The router restarts (empty index); the instances' snapshots rebuild it, and a repeat prompt
    is routed by it again: D alone (P skipped), with D's cached blocks back in ``/instances``."""
    spec = ClusterSpec(num_prefill=1, num_decode=1, heartbeat_interval_s=0.5, kv_deadline_s=10.0,
                       router_args=("--policy", "kv_aware"))
    with running_cluster(spec, tmp_path / "cluster.log") as cluster:
        url = cluster.router_url
        prompt = tokens(200, 3)
        (first,) = send_all(url, [body(prompt, stream=False, max_tokens=MAX_TOKENS)])
        assert first.ok, first.error
        held = (len(prompt) + MAX_TOKENS) // BLOCK - 1  # D caches the prompt and most of its answer
        wait_for(lambda: d_cached_blocks(url) >= held, 10.0, "D's KV events at the router")
        cluster.restart_router()
        wait_for(lambda: d_cached_blocks(url) >= held, 10.0, "D's KV snapshot at the new router")
        assert metric(url, "kvwire_router_skipped_prefills_total") == 0
        (again,) = send_all(url, [body(prompt, stream=False, max_tokens=MAX_TOKENS)])
        assert again.ok and again.token_ids == first.token_ids
        assert metric(url, "kvwire_router_skipped_prefills_total") == 1  # routed by the rebuilt index
