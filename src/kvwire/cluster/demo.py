"""``kvwire demo``: the README's main job. A local 1 prefill + 1 decode cluster on CPU with a real
instruct model (``smollm2-135m``: SmolLM2-135M-Instruct, a GGUF shipped on PyPI), a few chat
questions through the router (one streamed as it is generated), the answers with TTFT/ITL, the KV
handover seen in the instances' metrics, a check that P/D answered exactly what one colocated
engine answers (greedy, token for token), and a clean shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import sys
import textwrap
import time

import aiohttp

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster, http_text
from kvwire.errors import ClusterError, ModelLoadError
from kvwire.protocol.kv_params import TransferMode
from kvwire.secrets_config import generate_secret

DEFAULT_MODEL = "smollm2-135m"
QUESTIONS = (
    "What is the capital of France?",
    "Give me one tip for writing clear code.",
    "Write a short poem about the sea.",  # streamed
)
_PROMPT_TOKENS_BOUND = 256  # each question with its chat template is well under this (any tokenizer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name (smollm2-135m, tiny, ...), .gguf file or HF directory")  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default=TransferMode.PUSH.value)
    parser.add_argument("--max-tokens", type=int, default=40, help="most tokens per answer")
    parser.add_argument("--verbose", action="store_true", help="show every process's log lines")


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _stats(result: RequestResult, streamed: bool) -> str:
    if not result.ok:
        return f"FAILED ({result.status}) {result.error}"
    line = f"{result.num_output_tokens} tokens, finish={result.finish_reason}, "
    if not streamed:  # the whole answer arrives at once: its first token comes with the last
        return line + f"E2E {_ms(result.e2e_s)} (not streamed)"
    itl = sum(result.itls_s) / len(result.itls_s) if result.itls_s else None
    return line + f"TTFT {_ms(result.ttft_s)}, mean ITL {_ms(itl)}, E2E {_ms(result.e2e_s)}"


def _answer(text: str) -> str:
    lines = text.strip().splitlines() or [""]
    return "\n".join(textwrap.indent(line, "   ") for line in lines)


async def _ask(
    router_url: str, model: str, max_tokens: int, api_key: str | None = None
) -> list[RequestResult]:
    """Questions 1..n-1 concurrently, not streamed; the last one streamed and printed live."""
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    url = f"{router_url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(headers=headers) as session:
        plain = [post_completion(session, url, {**base, "messages": _messages(q)}) for q in QUESTIONS[:-1]]
        print(f"\nQ{len(QUESTIONS)} (streaming): {QUESTIONS[-1]}\n   ", end="", flush=True)

        def show(text: str) -> None:
            print(text.replace("\n", "\n   "), end="", flush=True)

        stream_body = {**base, "messages": _messages(QUESTIONS[-1]), "stream": True}
        streamed = post_completion(session, url, stream_body, on_text=show)
        *answers, last = await asyncio.gather(*plain, streamed)
    print(f"\n   [{_stats(last, streamed=True)}]")
    for i, (question, result) in enumerate(zip(QUESTIONS[:-1], answers, strict=True), start=1):
        print(f"\nQ{i}: {question}\n{_answer(result.text)}\n   [{_stats(result, streamed=False)}]")
    return [*answers, last]


def _colocated_token_ids(model: str, device: str, max_tokens: int) -> list[list[int]]:
    """The same greedy questions on one colocated engine (same weights, no P/D): the reference."""
    import torch

    from kvwire.engine import SamplingParams
    from kvwire.engine.llm import LLM

    if device == "cpu":  # torch may have been imported before run() set OMP_NUM_THREADS
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logging.getLogger("kvwire.engine").setLevel(logging.ERROR)  # no start-up lines amid the summary
    # A KV cache for these answers only (the default takes up to 1 GiB on the CPU).
    blocks_per_answer = (_PROMPT_TOKENS_BOUND + max_tokens) // 16 + 1
    llm = LLM(model=model, device=device, block_size=16, num_kv_blocks=len(QUESTIONS) * blocks_per_answer)
    try:
        prompts = [llm.tokenizer.apply_chat_template(_messages(q)) for q in QUESTIONS]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return [list(out.token_ids) for out in llm.generate(prompts, params)]
    finally:
        llm.close()


def _handover_summary(url: str | None, api_key: str | None = None) -> str:
    if url is None:
        return "n/a"
    try:
        text = http_text(f"{url}/metrics", timeout_s=5, api_key=api_key)
    except OSError as exc:  # URLError, timeouts, refused: say so, keep the demo's summary going
        return f"metrics unavailable ({exc})"
    wanted = ("kvwire_pd_transfers_completed_total", "kvwire_pd_transfer_bytes_total",
              "kvwire_kv_blocks_in_use", "kvwire_kv_peers")  # kvwire_kv_peers{transport}: the plane
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    return "; ".join(lines) or "no P/D metrics"


def _check_model(model: str) -> str | None:
    """A packaged model that is not installed: the message (before any process starts)."""
    from kvwire.engine.models.presets import PACKAGED_MODELS

    if model not in PACKAGED_MODELS:
        return None
    try:
        PACKAGED_MODELS[model].path(model)
    except ModelLoadError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        # P, D and the colocated reference share the machine's cores: one torch thread each unless
        # the user says otherwise (the instances inherit this environment). Two OpenMP threads per
        # process on a busy 2-core box spin against each other (docs/performance.md).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    problem = _check_model(args.model)
    if problem is not None:
        print(f"kvwire demo: {problem}", file=sys.stderr)
        return 2
    spec = ClusterSpec(num_prefill=1, num_decode=1, model=args.model, device=args.device,
                       mode=TransferMode(args.mode), port=0, secret=generate_secret())  # decision 124
    sink = sys.stdout if args.verbose else io.StringIO()
    print(f"kvwire demo: starting router + 1 prefill + 1 decode ({args.model} on {args.device}, {args.mode})")
    cluster = LocalCluster(spec, sink=sink)
    start = time.monotonic()
    try:
        cluster.start()
        ready_s = time.monotonic() - start
        print(f"kvwire demo: router at {cluster.router_url}, cluster ready in {ready_s:.1f} s")
        # A KVWIRE_API_KEY in the environment protects the demo's cluster too (LocalCluster.api_key).
        results = asyncio.run(_ask(cluster.router_url, args.model, args.max_tokens, cluster.api_key))
        print()
        for instance in cluster.instances.values():
            print(f"{instance.name} metrics: {_handover_summary(instance.url, cluster.api_key)}")
        ok = all(result.ok for result in results)
        ref_start = time.monotonic()
        reference = _colocated_token_ids(args.model, args.device, args.max_tokens)
        same = sum(r.token_ids == ref for r, ref in zip(results, reference, strict=True))
        print(f"P/D output == colocated output (greedy, token for token): {same}/{len(results)} requests "
              f"(colocated reference run in {time.monotonic() - ref_start:.1f} s)")
        ok = ok and same == len(results)
    except ClusterError as exc:
        print(f"kvwire demo: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    print("kvwire demo: cluster stopped" + ("" if ok else " (some requests failed)"))
    return 0 if ok else 1
