"""``kvwire bench serve``: an OpenAI-API load generator with TTFT/ITL/TPOT/E2E percentiles.

Against a running server or router (``--url``), or, without it, against local clusters it starts
itself (``--setups``, default ``1p1d,colocated``: the same load on a 1 prefill + 1 decode cluster
and on one colocated instance, both behind the router, in the same run; ``2colocated`` is two
colocated instances, the same instance and GPU count as ``1p1d``). Arrivals are Poisson
(``--arrival poisson``) or evenly spaced (``fixed``) at ``--request-rate`` requests/s (``inf``: all at
once); ``--max-concurrency`` caps requests in flight. Prompts are random token ids (``--input-len``),
outputs have exactly ``--output-len`` tokens (``ignore_eos``).

TTFT: request sent -> first streamed output token. ITL: gaps between streamed output chunks. TPOT:
(E2E - TTFT) / (output tokens - 1) per request. E2E: request sent -> last byte.

Example: ``kvwire bench serve --num-prompts 64 --input-len 256 --output-len 32 --request-rate 4``.

``--rounds N`` runs the setups N times, their order rotating, and adds each setup's p50 ratios to the
last one named, per round and their median (:mod:`kvwire.bench.serve_rounds`).

``--workload shared-prefix|multi-turn`` (prompt patterns, :mod:`kvwire.bench.workloads`) and
``--policies round_robin,least_loaded,kv_aware`` (router policies compared on the same sessions, with
prefix-hit rate and KV bytes per request: :mod:`kvwire.bench.serve_policies`) take the second path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from kvwire.bench import serve_rounds, serve_transfers, workloads
from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.errors import ClusterError
from kvwire.protocol.kv_params import TransferMode

# name -> (prefill, decode, colocated) instances; "2colocated" is the baseline with as many instances
# (and, with --spread-gpus 2, GPUs) as 1p1d: two colocated instances behind the router
SETUPS = {"1p1d": (1, 1, 0), "2p2d": (2, 2, 0), "colocated": (0, 0, 1), "2colocated": (0, 0, 2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="server or router base URL (default: start --setups)")
    parser.add_argument("--setups", default="1p1d,colocated", help=f"local clusters: {list(SETUPS)}")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu", help="device of locally started instances")
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default=TransferMode.PUSH.value)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens (ignore_eos)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf = all at once)")
    parser.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    parser.add_argument("--max-concurrency", type=int, default=0, help="0 = unlimited")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2,
                        help="requests sent (and not counted) first, with prompts of their own")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--plot", default=None, metavar="PNG", help="TTFT/ITL/E2E CDFs (matplotlib)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `kvwire serve` flag (repeat)")
    parser.add_argument("--router-arg", action="append", default=[],
                        help="extra `kvwire router` flag for local setups (repeat)")
    parser.add_argument("--spread-gpus", type=int, default=0,
                        help="local setups: instance k uses GPU k %% N (1P1D on 2 GPUs: P and D apart)")
    parser.add_argument("--policies", default=None,
                        help="router policies to compare in the same run, e.g. round_robin,least_loaded,"
                             "kv_aware (local setups; adds prefix-hit rate and KV bytes per request)")
    workloads.add_arguments(parser)


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    prompts: tuple[tuple[int, ...], ...]
    arrivals_s: tuple[float, ...]  # send offsets from the start
    output_len: int
    model: str
    max_concurrency: int
    timeout_s: float
    # sent (and answered) before the clock starts; prompts of their own, so that no timed request is
    # a prefix-cache hit on a warm-up's prompt
    warmup_prompts: tuple[tuple[int, ...], ...] = ()


def make_load(args: argparse.Namespace) -> LoadSpec:
    if args.num_prompts <= 0 or args.input_len <= 0 or args.output_len <= 0:
        raise ValueError("--num-prompts, --input-len and --output-len must be > 0")
    rng = random.Random(args.seed)
    prompts = tuple(
        tuple(rng.randrange(1, 250) for _ in range(args.input_len)) for _ in range(args.num_prompts)
    )
    offsets, now = [], 0.0
    for _ in range(args.num_prompts):
        offsets.append(now)
        if math.isfinite(args.request_rate) and args.request_rate > 0:
            gap = 1.0 / args.request_rate
            now += rng.expovariate(args.request_rate) if args.arrival == "poisson" else gap
    warm_rng = random.Random(f"warmup-{args.seed}")  # the timed prompts stay those of the seed
    warmup = tuple(
        tuple(warm_rng.randrange(1, 250) for _ in range(args.input_len)) for _ in range(max(args.warmup, 0))
    )
    return LoadSpec(
        prompts, tuple(offsets), args.output_len, args.model, args.max_concurrency, args.timeout_s, warmup
    )


def _body(load: LoadSpec, prompt: Sequence[int]) -> dict[str, Any]:
    return {"model": load.model, "prompt": list(prompt), "max_tokens": load.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and sys.stderr.isatty()

    def tick(self) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_load(
    url: str, load: LoadSpec, *, progress: bool = True, after_warmup: Callable[[], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send the load to ``url``; returns the results (in prompt order) and the wall time.
    ``after_warmup`` runs once the warm-up requests have been answered, before the clock starts."""
    endpoint = f"{url}/v1/completions"
    limit = asyncio.Semaphore(load.max_concurrency or len(load.prompts))
    bar = _Progress(len(load.prompts), progress)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for prompt in load.warmup_prompts:
            await post_completion(session, endpoint, _body(load, prompt), timeout_s=load.timeout_s)
        if after_warmup is not None:
            await asyncio.get_running_loop().run_in_executor(None, after_warmup)
        start = time.perf_counter()

        async def one(index: int) -> RequestResult:
            delay = load.arrivals_s[index] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                result = await post_completion(session, endpoint, _body(load, load.prompts[index]),
                                               timeout_s=load.timeout_s)
            bar.tick()
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(load.prompts))))
        return list(results), time.perf_counter() - start


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        low, high = math.floor(pos), math.ceil(pos)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"mean": sum(ordered) / len(ordered), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def summarize(name: str, results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itls_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.num_output_tokens > 1]
    out_tokens = sum(r.num_output_tokens for r in ok)
    errors = sorted({(r.error or "")[:120] for r in results if not r.ok})
    return {
        "setup": name, "requests": len(results), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": duration_s, "request_throughput": len(ok) / duration_s if duration_s else math.nan,
        "output_throughput": out_tokens / duration_s if duration_s else math.nan,
        "ttft_s": _percentiles(ttft), "itl_s": _percentiles(itl), "tpot_s": _percentiles(tpot),
        "e2e_s": _percentiles([r.e2e_s for r in ok]),
        "samples": {"ttft_s": ttft, "itl_s": itl, "e2e_s": [r.e2e_s for r in ok]},
    }


def _ms(stats: dict[str, float], key: str) -> str:
    value = stats[key]
    return "-" if math.isnan(value) else f"{value * 1000:.1f}"


def print_table(summaries: Sequence[dict[str, Any]]) -> None:
    head = (f"{'setup':<12}{'ok/all':>9}{'req/s':>8}{'tok/s':>9}  {'TTFT mean/p50/p99 ms':>24}"
            f"  {'ITL mean/p50/p99 ms':>22}  {'TPOT mean/p50 ms':>17}  {'E2E mean/p50/p99 ms':>25}")
    print(head)
    print("-" * len(head))
    for s in summaries:
        ok = f"{s['requests'] - s['failed']}/{s['requests']}"
        ttft, itl, tpot, e2e = s["ttft_s"], s["itl_s"], s["tpot_s"], s["e2e_s"]
        print(f"{s['setup']:<12}{ok:>9}{s['request_throughput']:>8.2f}{s['output_throughput']:>9.1f}  "
              f"{_ms(ttft, 'mean') + '/' + _ms(ttft, 'p50') + '/' + _ms(ttft, 'p99'):>24}  "
              f"{_ms(itl, 'mean') + '/' + _ms(itl, 'p50') + '/' + _ms(itl, 'p99'):>22}  "
              f"{_ms(tpot, 'mean') + '/' + _ms(tpot, 'p50'):>17}  "
              f"{_ms(e2e, 'mean') + '/' + _ms(e2e, 'p50') + '/' + _ms(e2e, 'p99'):>25}")
        for error in s["errors"]:
            print(f"    error: {error}")
        if "kv_transfers" in s:
            print(f"    {serve_transfers.describe(s['kv_transfers'])}")
        if "handover" in s:
            print(f"    {serve_transfers.describe_handover(s['handover'])}")


def plot(summaries: Sequence[dict[str, Any]], path: str) -> bool:
    """CDFs of TTFT, ITL and E2E per setup; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvwire bench serve: --plot needs matplotlib (pip install 'kvwire[plot]')", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL", "E2E"), strict=True):
        several = any(s.get("round", 1) > 1 for s in summaries)
        for s in summaries:
            values = sorted(v * 1000 for v in s["samples"][key])
            label = f"{s['setup']} (round {s['round']})" if several else s["setup"]
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _bench_setup(name: str, args: argparse.Namespace, load: LoadSpec) -> dict[str, Any]:
    num_p, num_d, num_both = SETUPS[name]
    spec = ClusterSpec(num_prefill=num_p, num_decode=num_d, num_both=num_both, model=args.model,
                       device=args.device, mode=TransferMode(args.mode), port=0,
                       serve_args=tuple(args.serve_arg), router_args=tuple(args.router_arg),
                       spread_gpus=args.spread_gpus,
                       start_timeout_s=600.0)
    with open_log(name) as sink, LocalCluster(spec, sink=sink) as cluster:
        print(f"kvwire bench serve: {name} up at {cluster.router_url}", file=sys.stderr)
        urls = [inst.url for inst in cluster.instances.values() if inst.url]
        # the warm-up's transfers (first launches, first allocations) are not the load's
        marks: dict[str, Any] = {}

        def take_marks() -> None:
            marks["transfers"] = serve_transfers.mark(urls)
            marks["copies"] = serve_transfers.device_copies(urls)

        results, duration = asyncio.run(
            run_load(cluster.router_url, load, progress=not args.no_progress,
                     after_warmup=take_marks if num_p or num_d else None)
        )
        summary = summarize(name, results, duration)
        if num_p or num_d:  # in-serving transfer GB/s, and the ceiling on the same bytes (same run)
            since = marks.get("transfers")
            copied = serve_transfers.device_copies(urls)
            before = marks.get("copies", (0.0, 0.0))
            rows = serve_transfers.collect(urls, since)
            summary["kv_transfers"] = serve_transfers.summarize(
                rows, with_ceiling=args.device == "cpu",
                device_copy=(copied[0] - before[0], copied[1] - before[1]),
            )
            summary["handover"] = serve_transfers.exposed_handover(urls, summary["samples"]["ttft_s"], since)
    return summary


def open_log(name: str) -> Any:
    """Instance logs of a locally started setup go to a file next to the current directory."""
    return open(f"kvwire-bench-serve-{name}.log", "w")


def run(args: argparse.Namespace) -> int:
    if args.policies or args.workload != workloads.Workload.RANDOM.value:
        return _run_compare(args)
    try:
        load = make_load(args)
        names = [n.strip() for n in args.setups.split(",") if n.strip()]
        unknown = [n for n in names if n not in SETUPS]
        if unknown and args.url is None:
            raise ValueError(f"unknown setups {unknown}; choose from {list(SETUPS)}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        if args.rounds > 1 and args.url is not None:
            raise ValueError("--rounds compares local --setups; it does not apply with --url")
    except ValueError as exc:
        print(f"kvwire bench serve: {exc}", file=sys.stderr)
        return 2
    summaries = []
    rounds: list[list[dict[str, Any]]] = []
    failed = False
    try:
        if args.url is not None:
            results, duration = asyncio.run(
                run_load(args.url.rstrip("/"), load, progress=not args.no_progress)
            )
            summaries.append(summarize(args.url, results, duration))
        else:
            for index in range(args.rounds):
                order = serve_rounds.round_order(len(names), index)
                done = {pos: _bench_setup(names[pos], args, load) for pos in order}
                rounds.append([dict(done[pos], round=index + 1) for pos in range(len(names))])
    except ClusterError as exc:
        print(f"kvwire bench serve: {exc}", file=sys.stderr)
        if not rounds:
            return 1
        # the rounds that finished are still reported (a long --rounds run keeps what it measured)
        print(f"kvwire bench serve: reporting the {len(rounds)} round(s) that finished", file=sys.stderr)
        failed = True
    summaries = summaries or [s for summaries_of_round in rounds for s in summaries_of_round]
    plotted = plot(summaries, args.plot) if args.plot else True
    if args.json:
        print(json.dumps([{k: v for k, v in s.items() if k != "samples"} for s in summaries], indent=2))
    else:
        print(f"{len(load.prompts)} prompts x {len(load.prompts[0])} tokens -> {load.output_len} tokens, "
              f"rate {args.request_rate} req/s ({args.arrival}), "
              f"max concurrency {args.max_concurrency or 'inf'}")
        if len(rounds) > 1:
            for index, summaries_of_round in enumerate(rounds):
                ran = ", ".join(names[pos] for pos in serve_rounds.round_order(len(names), index))
                print(f"round {index + 1} of {len(rounds)} (run in the order {ran})")
                print_table(summaries_of_round)
            serve_rounds.print_ratios(serve_rounds.ratios(rounds), len(rounds))
        else:
            print_table(summaries)
    return 0 if plotted and not failed and all(s["failed"] == 0 for s in summaries) else 1


def _run_compare(args: argparse.Namespace) -> int:
    """Sessions of ``--workload`` through each of ``--policies`` (kvwire.bench.serve_policies)."""
    from kvwire.bench.serve_policies import print_policy_table, run_compare

    try:
        if args.url is not None:
            raise ValueError("--policies/--workload start local setups; drop --url")
        unknown = [n for n in args.setups.split(",") if n.strip() and n.strip() not in SETUPS]
        if unknown:
            raise ValueError(f"unknown setups {unknown}; choose from {list(SETUPS)}")
        summaries = run_compare(args, SETUPS)
    except ValueError as exc:
        print(f"kvwire bench serve: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"kvwire bench serve: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{k: v for k, v in s.items() if k != "samples"} for s in summaries], indent=2))
    else:
        print(f"workload {args.workload}: {summaries[0]['requests'] if summaries else 0} requests, "
              f"input {args.input_len} (+{args.suffix_len}) tokens -> {args.output_len} tokens, "
              f"rate {args.request_rate} req/s ({args.arrival}), "
              f"max concurrency {args.max_concurrency or 'inf'}")
        print_policy_table(summaries)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
