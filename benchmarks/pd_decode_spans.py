"""What a decode instance spends CPU on per P/D request, by thread and call (decision 158).

Starts a 1P1D cluster (tiny model, CPU, push, default plane) whose decode instance loads
``benchmarks/pd_decode_spans_site/sitecustomize.py`` (thread-CPU timers around D's admission, engine
loop, connector and receive-side calls; nothing in ``src/``), sends a warm-up, then ``--requests``
sequential streamed requests through the router, ``--gap-s`` apart, and prints D's on-CPU time per
request for each thread and each timed call (calls per request, CPU per call). Calls made in engine
steps that scheduled nothing (D's admission step, its polls while it waits for the KV, the step the
KV's arrival wakes) are listed with ``E:``. The timers add a few microseconds per call. Run from a
worktree root:

    PYTHONPATH=src python benchmarks/pd_decode_spans.py --requests 60 --max-tokens 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_prefill_ttft import _prompts
from pd_step_spans import _requests, probed_cluster

SITE = Path(__file__).resolve().parent / "pd_decode_spans_site"


def _table(result: dict[str, dict[str, object]], n: int) -> None:
    threads: dict[str, int] = result["threads"]  # type: ignore[assignment]
    print("D's threads, CPU ms per request:")
    for name, ns in sorted(threads.items(), key=lambda kv: -kv[1]):
        if ns:
            print(f"  {ns / 1e6 / n:7.3f}  {name}")
    spans: dict[str, list[int]] = result["spans"]  # type: ignore[assignment]
    print("D's calls: CPU ms per request, calls per request, CPU us per call  thread|call")
    for key, (calls, ns) in sorted(spans.items(), key=lambda kv: -kv[1][1]):
        if calls:
            print(f"  {ns / 1e6 / n:7.3f}  x{calls / n:5.1f}  {ns / 1e3 / calls:8.1f}  {key}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--gap-s", type=float, default=0.15)
    args = ap.parse_args(argv)
    with probed_cluster(SITE, "PD_DECODE_SPANS_DIR") as (cluster, out):
        _requests(cluster.router_url, _prompts(0, 6, args.input_len), args.max_tokens, args.gap_s)
        (out / "start").touch()
        deadline = time.monotonic() + 10
        while (out / "start").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        ttft = _requests(cluster.router_url, _prompts(1, args.requests, args.input_len), args.max_tokens,
                         args.gap_s)
        (out / "dump").touch()
        while not (out / "spans.json").exists() and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        print(f"{args.requests} requests through the router, client TTFT p50 {ttft:.2f} ms")
        _table(json.loads((out / "spans.json").read_text()), args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
