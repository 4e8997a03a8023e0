"""P's engine TTFT for P/D requests against the same prompts sent to P without kv_transfer_params.

Starts a 1P1D cluster (tiny model, CPU, default plane), then alternates rounds: ``--requests``
sequential streamed requests through the router (P/D), then the same number straight to P without
``kv_transfer_params`` (plain, one token). Per round it reads P's ``kvwire_time_to_first_token_seconds``
(sum/count: mean, request admitted -> first token out of the engine loop) and the client's TTFT
through the router. Prints one line per round and a JSON summary. Run from a worktree root:

    PYTHONPATH=src python benchmarks/pd_prefill_ttft.py --rounds 3 --requests 30
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from kvwire.cluster.local import ClusterSpec, LocalCluster, http_text


def _metric(url: str, name: str) -> tuple[float, float]:
    text = http_text(f"{url}/metrics", timeout_s=10.0)
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum "):
            total = float(line.split()[1])
        elif line.startswith(f"{name}_count "):
            count = float(line.split()[1])
    return total, count


def _post(url: str, body: dict[str, Any]) -> float:
    """Streamed completion; seconds to the first data chunk."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    sent = time.monotonic()
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:300]!r}")
    first = None
    for line in resp:
        if first is None and line.startswith(b"data:"):
            first = time.monotonic()
    conn.close()
    return (first or time.monotonic()) - sent


def _round(
    url: str, p_url: str, prompts: list[list[int]], max_tokens: int, gap_s: float
) -> tuple[float, float]:
    """Mean engine TTFT on P (ms) over these requests, and the clients' TTFT p50 (ms)."""
    before = _metric(p_url, "kvwire_time_to_first_token_seconds")
    client = []
    for prompt in prompts:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        client.append(_post(url, body))
        time.sleep(gap_s)
    after = _metric(p_url, "kvwire_time_to_first_token_seconds")
    n = after[1] - before[1]
    return 1e3 * (after[0] - before[0]) / max(n, 1), 1e3 * statistics.median(client)


def _prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)  # fresh prompts each round: no prefix-cache hit on P or D
    return [[rng.randrange(1, 250) for _ in range(length)] for _ in range(count)]


def _rounds(cluster: LocalCluster, args: argparse.Namespace) -> list[dict[str, float]]:
    p_url = next(i.url for i in cluster.instances.values() if i.role.value == "prefill")
    assert p_url is not None
    _round(cluster.router_url, p_url, _prompts(0, 3, args.input_len), 4, args.gap_s)  # warm-up
    rows: list[dict[str, float]] = []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        pd_prompts, plain_prompts = (_prompts(2 * r + k + 1, args.requests, args.input_len) for k in (0, 1))
        pd_engine, pd_client = _round(cluster.router_url, p_url, pd_prompts, 4, args.gap_s)
        plain_engine, plain_client = _round(p_url, p_url, plain_prompts, 1, args.gap_s)
        rows.append({"round": r, "load": load, "pd_engine_ttft_ms": pd_engine,
                     "plain_engine_ttft_ms": plain_engine, "pd_client_ttft_p50_ms": pd_client,
                     "plain_client_ttft_p50_ms": plain_client})  # fmt: skip
        print(f"round {r} load {load:.1f}: P engine TTFT P/D {pd_engine:.2f} ms, plain"
              f" {plain_engine:.2f} ms; client p50 P/D via router {pd_client:.2f} ms, plain to P"
              f" {plain_client:.2f} ms", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--gap-s", type=float, default=0.15)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `kvwire serve` flag")
    args = ap.parse_args(argv)
    with tempfile.TemporaryFile("w+") as sink, LocalCluster(
        ClusterSpec(serve_args=tuple(args.serve_arg)), sink=sink
    ) as cluster:
        rows = _rounds(cluster, args)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
