"""``kvwire demo``: the README's main job. A local 1 prefill + 1 decode cluster on the built-in tiny
model (CPU), a few requests through the router (one streaming), outputs with TTFT/ITL, the KV
handover seen in the instances' metrics, and a clean shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import urllib.request

import aiohttp

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.errors import ClusterError
from kvwire.kv_params import TransferMode

PROMPTS = (
    "The quick brown fox",
    "Disaggregated serving splits prefill and decode so that",
    "KV caches move between processes layer by layer, and",
)
CHAT_MESSAGES = [{"role": "user", "content": PROMPTS[2]}]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="preset name or local HF directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default=TransferMode.PUSH.value)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--verbose", action="store_true", help="show every process's log lines")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _describe(label: str, result: RequestResult) -> str:
    if not result.ok:
        return f"{label}: FAILED ({result.status}) {result.error}"
    itl = sum(result.itls_s) / len(result.itls_s) if result.itls_s else None
    return (
        f"{label}: {result.num_output_tokens} tokens, finish={result.finish_reason}, "
        f"TTFT {_ms(result.ttft_s)}, mean ITL {_ms(itl)}, E2E {_ms(result.e2e_s)}\n"
        f"    -> {result.text!r}"
    )


async def _requests(
    router_url: str, model: str, max_tokens: int, api_key: str | None = None
) -> list[tuple[str, RequestResult]]:
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(headers=headers) as session:
        url = f"{router_url}/v1/completions"
        plain = [post_completion(session, url, {**base, "prompt": p}) for p in PROMPTS[:2]]
        chat_body = {**base, "messages": CHAT_MESSAGES, "stream": True}
        streamed = post_completion(session, f"{router_url}/v1/chat/completions", chat_body)
        results = await asyncio.gather(*plain, streamed)
    labels = ["completion 1", "completion 2", "chat (streaming)"]
    return list(zip(labels, results, strict=True))


def _colocated_token_ids(model: str, device: str, max_tokens: int) -> list[list[int]]:
    """The same greedy requests on one colocated engine (same weights, no P/D): the reference."""
    from kvwire.engine import SamplingParams
    from kvwire.engine.llm import LLM

    llm = LLM(model=model, device=device)
    try:
        prompts: list[list[int]] = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
        prompts.append(llm.tokenizer.apply_chat_template(CHAT_MESSAGES))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [list(out.token_ids) for out in llm.generate(prompts, params)]
    finally:
        llm.close()


def _handover_summary(url: str | None, api_key: str | None = None) -> str:
    if url is None:
        return "n/a"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            text = resp.read().decode()
    except OSError as exc:  # URLError, timeouts, refused: say so, keep the demo's summary going
        return f"metrics unavailable ({exc})"
    wanted = ("kvwire_pd_transfers_completed_total", "kvwire_pd_transfer_bytes_total",
              "kvwire_kv_blocks_in_use", "kvwire_kv_peers")  # kvwire_kv_peers{transport}: the plane
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    return "; ".join(lines) or "no P/D metrics"


def run(args: argparse.Namespace) -> int:
    spec = ClusterSpec(num_prefill=1, num_decode=1, model=args.model, device=args.device,
                       mode=TransferMode(args.mode), port=0)
    sink = sys.stdout if args.verbose else io.StringIO()
    print(f"kvwire demo: starting router + 1 prefill + 1 decode ({args.model} on {args.device}, {args.mode})")
    cluster = LocalCluster(spec, sink=sink)
    try:
        cluster.start()
        print(f"kvwire demo: router at {cluster.router_url}")
        # A KVWIRE_API_KEY in the environment protects the demo's cluster too (LocalCluster.api_key).
        results = asyncio.run(_requests(cluster.router_url, args.model, args.max_tokens, cluster.api_key))
        for label, result in results:
            print(_describe(label, result))
        for instance in cluster.instances.values():
            print(f"{instance.name} metrics: {_handover_summary(instance.url, cluster.api_key)}")
        ok = all(result.ok for _, result in results)
        reference = _colocated_token_ids(args.model, args.device, args.max_tokens)
        same = sum(r.token_ids == ref for (_, r), ref in zip(results, reference, strict=True))
        print(f"P/D output == colocated output (greedy, token for token): {same}/{len(results)} requests")
        ok = ok and same == len(results)
    except ClusterError as exc:
        print(f"kvwire demo: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    print("kvwire demo: cluster stopped" + ("" if ok else " (some requests failed)"))
    return 0 if ok else 1
