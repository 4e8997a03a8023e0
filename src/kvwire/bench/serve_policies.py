"""``kvwire bench serve --policies a,b,c``: the same workload through each router policy, in one run.

For every local setup (``--setups``, e.g. ``2p2d``) and policy, a fresh cluster is started (cold
caches, same seed, same sessions) with ``kvwire router --policy <policy>`` and the workload
(:mod:`kvwire.bench.workloads`) is sent. Besides the latency table of ``bench serve`` it reports,
scraped from the instances' and the router's ``/metrics`` after the run:

* prefix-hit rate: prompt tokens the instances found in their own prefix caches / prompt tokens
  they admitted (P and D both count; a D that loaded KV from P did not hit);
* KV bytes moved per request: bytes prefill instances sent to decode instances / requests;
* skipped prefills and partial transfers (``kv_aware``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvwire.bench.workloads import Session, carry_tokens
from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.protocol.kv_params import TransferMode


async def run_sessions(
    url: str, sessions: Sequence[Session], *, model: str, output_len: int, timeout_s: float,
    max_concurrency: int = 0, warmup: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send every session (turns in order, sessions concurrently from their offsets)."""
    endpoint = f"{url}/v1/completions"
    limit = asyncio.Semaphore(max_concurrency or max(1, sum(len(s.turns) for s in sessions)))

    def body(prompt: Sequence[int]) -> dict[str, Any]:
        return {"model": model, "prompt": list(prompt), "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for k in range(warmup):  # prompts unrelated to the workload's (no shared prefix)
            await post_completion(http, endpoint, body([250 - k] * 64), timeout_s=timeout_s)
        start = time.perf_counter()

        async def one(session: Session) -> list[RequestResult]:
            delay = session.start_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            out: list[RequestResult] = []
            prompt: tuple[int, ...] = ()
            for i, turn in enumerate(session.turns):
                carried = prompt + carry_tokens(out[-1].token_ids) if i > 0 and session.carry else ()
                prompt = carried + turn
                async with limit:
                    out.append(await post_completion(http, endpoint, body(prompt), timeout_s=timeout_s))
                if not out[-1].ok:
                    break
            return out

        per_session = await asyncio.gather(*(one(s) for s in sessions))
        return [r for rs in per_session for r in rs], time.perf_counter() - start


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on ``url``/metrics whose labels include ``labels``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def kv_counters(cluster: LocalCluster) -> dict[str, float]:
    out = {"hit_tokens": 0.0, "prompt_tokens": 0.0, "kv_bytes": 0.0}
    for inst in cluster.live_instances():
        if inst.url is None:
            continue
        out["hit_tokens"] += scrape(inst.url, "kvwire_prefix_cache_hit_tokens_total")
        out["prompt_tokens"] += scrape(inst.url, "kvwire_prompt_tokens_total")
        if inst.role == "prefill":
            out["kv_bytes"] += scrape(inst.url, "kvwire_pd_transfer_bytes_total", side="send")
        if inst.role == "decode":  # requests each decode instance finished (how evenly D is shared)
            out[f"d_requests:{inst.name}"] = scrape(inst.url, "kvwire_requests_total")
    out["skipped"] = scrape(cluster.router_url, "kvwire_router_skipped_prefills_total")
    out["partial"] = scrape(cluster.router_url, "kvwire_router_partial_transfers_total")
    return out


def bench_policy(
    setup: tuple[int, int, int], name: str, policy: str | None, args: argparse.Namespace,
    sessions: Sequence[Session],
) -> tuple[list[RequestResult], float, dict[str, float]]:
    """One cluster with ``--policy policy`` (None: the router's default): the results, the wall time
    and the KV counters' deltas."""
    from kvwire.bench.serve import open_log

    num_p, num_d, num_both = setup
    spec = ClusterSpec(num_prefill=num_p, num_decode=num_d, num_both=num_both, model=args.model,
                       device=args.device, mode=TransferMode(args.mode), port=0,
                       serve_args=tuple(args.serve_arg), spread_gpus=args.spread_gpus,
                       start_timeout_s=600.0, router_args=("--policy", policy) if policy else ())
    with open_log(f"{name}-{policy or 'default'}") as sink, LocalCluster(spec, sink=sink) as cluster:
        before = kv_counters(cluster)
        results, duration = asyncio.run(run_sessions(
            cluster.router_url, sessions, model=args.model, output_len=args.output_len,
            timeout_s=args.timeout_s, max_concurrency=args.max_concurrency, warmup=args.warmup,
        ))
        after = kv_counters(cluster)
    return results, duration, {k: after[k] - before[k] for k in after}


def run_compare(args: argparse.Namespace, setups: dict[str, tuple[int, int, int]]) -> list[dict[str, Any]]:
    """Every setup of ``args.setups`` x every policy of ``args.policies`` on ``args.workload``, for
    ``args.rounds`` rounds. Each round runs every policy once, in an order rotated by one per round,
    so that a policy is not always the one measured first (or last) while the box's load drifts;
    each summary carries its ``round`` (1-based)."""
    from kvwire.bench.serve import summarize
    from kvwire.bench.serve_rounds import round_order
    from kvwire.bench.workloads import make_sessions

    sessions = make_sessions(args)
    policies: list[str | None] = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
    policies = policies or [None]
    rounds = getattr(args, "rounds", 1)
    if rounds <= 0:
        raise ValueError("--rounds must be > 0")
    summaries = []
    for round_ in range(rounds):
        order = [policies[i] for i in round_order(len(policies), round_)]
        for name in [n.strip() for n in args.setups.split(",") if n.strip()]:
            for policy in order:
                results, duration, counters = bench_policy(setups[name], name, policy, args, sessions)
                summary = summarize(f"{name}/{policy or 'default'}", results, duration)
                summary["kv"] = kv_summary(counters, len(results))
                summary["round"] = round_ + 1
                summaries.append(summary)
    return summaries


def kv_summary(counters: dict[str, float], num_requests: int) -> dict[str, float]:
    prompt = counters["prompt_tokens"]
    per_d = [v for k, v in counters.items() if k.startswith("d_requests:")]
    return {
        "prefix_hit_rate": counters["hit_tokens"] / prompt if prompt else 0.0,
        "kv_bytes_per_request": counters["kv_bytes"] / num_requests if num_requests else 0.0,
        "skipped_prefills": counters["skipped"],
        "partial_transfers": counters["partial"],
        # the busiest decode instance's share of the requests (1/num_decode = even)
        "busiest_decode_share": max(per_d) / sum(per_d) if sum(per_d) else 0.0,
    }


def _key(summary: dict[str, Any]) -> tuple[str, int]:
    return summary["setup"].split("/")[0], int(summary.get("round", 1))


def _round_robin_of(summaries: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {_key(s): s for s in summaries if s["setup"].endswith("/round_robin")}


def ttft_ratio(summary: dict[str, Any], base: dict[tuple[str, int], dict[str, Any]]) -> float | None:
    """TTFT p50 over round robin's in the same setup and round (None without a round robin run)."""
    rr = base.get(_key(summary))
    if rr is None or not rr["ttft_s"]["p50"]:
        return None
    return float(summary["ttft_s"]["p50"] / rr["ttft_s"]["p50"])


def print_policy_table(summaries: Sequence[dict[str, Any]]) -> None:
    rounds = max((int(s.get("round", 1)) for s in summaries), default=1)
    head = (f"{'setup/policy':<22}{'round':>6}{'ok/all':>9}{'req/s':>8}{'tok/s':>9}{'TTFT p50 ms':>13}"
            f"{'p99 ms':>9}{'vs rr':>7}{'hit %':>7}{'KV KiB/req':>12}{'vs rr':>7}{'skipped':>9}"
            f"{'partial':>9}{'D max %':>9}")
    print(head)
    print("-" * len(head))
    base = _round_robin_of(summaries)
    for s in sorted(summaries, key=_key):  # stable: each round in its run order
        rr = base.get(_key(s))
        kv, ttft = s["kv"], s["ttft_s"]
        ok = f"{s['requests'] - s['failed']}/{s['requests']}"
        ratio = ttft_ratio(s, base)
        ttft_vs = "-" if ratio is None else f"{ratio:.2f}"
        rr_bytes = rr["kv"]["kv_bytes_per_request"] if rr else 0.0
        bytes_ratio = f"{kv['kv_bytes_per_request'] / rr_bytes:.2f}" if rr_bytes else "-"
        print(f"{s['setup']:<22}{s.get('round', 1):>6}{ok:>9}{s['request_throughput']:>8.2f}"
              f"{s['output_throughput']:>9.1f}{ttft['p50'] * 1000:>13.1f}{ttft['p99'] * 1000:>9.1f}"
              f"{ttft_vs:>7}"
              f"{kv['prefix_hit_rate'] * 100:>7.1f}{kv['kv_bytes_per_request'] / 1024:>12.1f}{bytes_ratio:>7}"
              f"{kv['skipped_prefills']:>9.0f}{kv['partial_transfers']:>9.0f}"
              f"{kv.get('busiest_decode_share', 0.0) * 100:>9.0f}")
        for error in s["errors"]:
            print(f"    error: {error}")
    if rounds > 1:
        print_round_summary(summaries)


def print_round_summary(summaries: Sequence[dict[str, Any]]) -> None:
    """Per setup/policy: TTFT p50 vs round robin in each round, and their median."""
    base = _round_robin_of(summaries)
    ratios: dict[str, list[float]] = {}
    for s in summaries:
        ratio = ttft_ratio(s, base)
        if ratio is not None:
            ratios.setdefault(s["setup"], []).append(ratio)
    print(f"\n{'setup/policy':<22}{'TTFT p50 vs rr, median':>24}   per round")
    for setup, values in ratios.items():
        print(f"{setup:<22}{statistics.median(values):>24.2f}   {' '.join(f'{v:.2f}' for v in values)}")
