"""Real vLLM, P and D of different tensor-parallel sizes (decision 086): a prefill instance with
``--tensor-parallel-size 2`` hands its KV to a TP 1 instance (the tier's ``kv_both``), pull mode. D's
one rank merges the heads of P's two ranks (one piece from each); the output equals plain vLLM token
for token and D computes only the last prompt token itself.

Runs last in the tier (after the session cluster's P and D are gone): a TP 2 engine starts four
busy-polling processes, which would slow every other test of this 2-core box if it ran alongside.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import (
    MAX_MODEL_LEN,
    STARTUP_TIMEOUT_S,
    Cluster,
    Proc,
    healthy,
    kv_transfer_config,
    metric_total,
    vllm_env,
    wait_until,
)
from test_vllm_pd import complete, kv_blocks_released, outputs, prompts

from support.waiting import free_port

# P's lease (a pull's deadline is capped at the instance's lease_s, 30 s by default, so both are set):
# generous, the box is shared and a TP 2 engine is slow to warm up
DEADLINE_S = 60.0


def local_compute(port: int) -> float:
    return metric_total(port, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


@pytest.fixture(scope="module")
def p_tp2(cluster: Cluster, model_dir: Path) -> Iterator[int]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
        "--shutdown-timeout", "10",
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
        # eager: the two workers' torch.compile warm-up cost 140 s of a 333 s start-up on the shared
        # box; what this test checks is where the KV heads go, not compiled kernels
        "--enforce-eager",
        "--kv-transfer-config",
        kv_transfer_config("kv_producer", {"deadline_s": DEADLINE_S, "lease_s": DEADLINE_S}),
    ]  # fmt: skip
    proc = Proc("prefill-tp2", cmd, cluster.log_dir / "prefill-tp2.log", vllm_env())
    try:
        wait_until(lambda: healthy(port), STARTUP_TIMEOUT_S, [proc], "vLLM TP 2 prefill")
        yield port
    finally:
        proc.stop(grace_s=10)


def test_prefill_tp2_to_decode_tp1(cluster: Cluster, p_tp2: int) -> None:
    p_url = f"http://127.0.0.1:{p_tp2}"
    d_url = f"http://127.0.0.1:{cluster.both_port}"  # TP 1, kv_both: decodes with pull params
    log = (cluster.log_dir / "prefill-tp2.log").read_text(errors="replace")
    assert "rank 1 of 2" in log and "(block_head)" in log, "P's ranks did not register head views"
    fresh = prompts(4)  # prompts no instance saw: D's prefix cache cannot stand in for P's KV
    picked = [fresh[i] for i in (5, 9, 10)]  # 129, 389 and 600 tokens (CPU blocks of 128)
    expected = outputs(f"http://127.0.0.1:{cluster.ref_port}", picked)
    complete(p_url, fresh[0])  # warm P's two ranks up (its first forward is slow on this box)
    before = local_compute(cluster.both_port)
    for i, (prompt, want) in enumerate(zip(picked, expected, strict=True)):
        params = {"transfer_id": f"tp2-{i}", "mode": "pull", "role": "prefill", "deadline_s": DEADLINE_S}
        answer = complete(p_url, prompt, extra={"max_tokens": 1, "kv_transfer_params": params})
        d_params = dict(answer["kv_transfer_params"], role="decode")
        assert len(d_params["peer_endpoints"]) == 2, d_params  # one per P rank
        out = complete(d_url, prompt, extra={"kv_transfer_params": d_params})["choices"][0]
        assert (out.get("token_ids"), out["text"]) == want, f"prompt of {len(prompt)} tokens"
    # D computed only the last token of each prompt: the KV came from P's two ranks.
    deadline = time.monotonic() + 30
    computed = 0.0
    while time.monotonic() < deadline:
        computed = local_compute(cluster.both_port) - before
        if computed >= len(picked):
            break
        time.sleep(0.5)
    assert computed == len(picked), f"D computed {computed} prompt tokens; expected 1 per request"
    assert kv_blocks_released(p_tp2, 30), "P kept KV blocks"
