"""Where a 1P1D request's TTFT goes, against colocated: sequential streaming requests through the
router of a local 1P1D cluster and of a local colocated one (model ``tiny``, push), alternating.

For each setup and round it prints the client's TTFT (p50, mean), the router's own TTFT histogram
(``kvwire_router_ttft_seconds``, mean) and each instance's engine TTFT
(``kvwire_time_to_first_token_seconds``: request admitted -> first token, mean). Client minus engine
is what the HTTP hops and the router add; the instances' engine figures show whether P's step is
slower than the colocated instance's. Usage::

    PYTHONPATH=src python benchmarks/ttft_split.py --rounds 2 --requests 40 --prompt-words 27
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from urllib.parse import urlparse

from kvwire.cluster.local import ClusterSpec, LocalCluster, http_text
from kvwire.protocol.kv_params import TransferMode

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]


def first_token_s(url: str, prompt: str, max_tokens: int = 8) -> float:
    """Seconds from sending a streaming completion to its first event that carries text."""
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=60)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = None
    while line := response.readline():
        if first is None and line.startswith(b"data: {") and b'"text"' in line:
            first = time.perf_counter() - start
    conn.close()
    if first is None:
        raise RuntimeError(f"no token streamed from {url}")
    return first


def histogram_mean(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram summed over its label sets."""
    total = count = 0.0
    for line in http_text(url + "/metrics").splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count += float(line.split()[-1])
    return total, count


def one_setup(name: str, counts: tuple[int, int, int], args: argparse.Namespace) -> str:
    num_p, num_d, num_both = counts
    spec = ClusterSpec(num_prefill=num_p, num_decode=num_d, num_both=num_both, model="tiny", port=0,
                       mode=TransferMode.PUSH, serve_args=tuple(args.serve_arg))
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
    log_path = os.path.join(tempfile.gettempdir(), f"kvwire-ttft-split-{name}.log")  # the instances' logs
    with open(log_path, "w") as sink, LocalCluster(spec, sink=sink) as cluster:
        for i in range(5):
            first_token_s(cluster.router_url, f"warm {i} {prompt}")
        urls = {k: inst.url for k, inst in cluster.instances.items() if inst.url}
        engine_before = {k: histogram_mean(u, "kvwire_time_to_first_token_seconds") for k, u in urls.items()}
        router_before = histogram_mean(cluster.router_url, "kvwire_router_ttft_seconds")
        client = []
        for i in range(args.requests):
            client.append(first_token_s(cluster.router_url, f"{i} {i * 7} {prompt}"))
            time.sleep(args.gap_s)
        engine = {}
        for k, u in urls.items():
            total, count = histogram_mean(u, "kvwire_time_to_first_token_seconds")
            engine[k] = (total - engine_before[k][0]) / max(1.0, count - engine_before[k][1]) * 1e3
        total, count = histogram_mean(cluster.router_url, "kvwire_router_ttft_seconds")
        router_ms = (total - router_before[0]) / max(1.0, count - router_before[1]) * 1e3
    engines = ", ".join(f"{k} {v:.2f}" for k, v in engine.items())
    return (f"| {name} | {statistics.median(client) * 1e3:.2f} | {statistics.mean(client) * 1e3:.2f} | "
            f"{router_ms:.2f} | {engines} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-words", type=int, default=27, help="~5 tokens a word (tiny: bytes)")
    parser.add_argument("--gap-s", type=float, default=0.15, help="pause between requests")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an argument for every instance (repeatable)")
    args = parser.parse_args(argv)
    print("| setup | client TTFT p50 ms | client mean | router TTFT mean | engine TTFT mean per instance |")
    print("|---|---|---|---|---|")
    for _ in range(args.rounds):
        for name, counts in (("1p1d", (1, 1, 0)), ("colocated", (0, 0, 1))):
            print(one_setup(name, counts, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
