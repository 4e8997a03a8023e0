"""What a user types on a one-GPU machine: ``kvwire up --prefill 1 --decode 1 --device cuda --model
llama3-8b-random``, on every default (``--kv-transport auto``, KV cache sized from free memory).
P and D share the GPU: they start one after the other (each sizes its KV cache from the memory the
other left), the agents negotiate CUDA IPC, and requests complete with D loading P's KV (no
recompute). Run on the GPU machine: ``pytest -m gpu tests/gpu/test_up_one_gpu.py``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvwire.cluster.local import free_port, http_json
from support.pd_gpu import body, metric, send

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_kvwire_up_on_one_gpu_moves_kv_over_ipc(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "kvwire.cli", "up", "--prefill", "1", "--decode", "1", "--device", "cuda",
            "--model", "llama3-8b-random", "--port", str(port), "--start-timeout-s", "400"]
    log = tmp_path / "up.log"
    sink = open(log, "w")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        alive: list[dict] = []
        while len(alive) < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "cluster not up in time"
            with contextlib.suppress(OSError, ValueError):
                alive = [e for e in http_json(f"{url}/instances") if e.get("alive")]
            time.sleep(0.5)
        decode = next(e["url"] for e in alive if e["role"] == "decode")
        prompts = [[(31 * i + 7 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate((17, 300, 1500))]
        bodies = [dict(body(p, stream=bool(i % 2)), model="llama3-8b-random") for i, p in enumerate(prompts)]
        results = asyncio.run(send(url, bodies))
        assert all(r.ok and len(r.token_ids) == 8 for r in results), [r.error for r in results]
        assert metric(decode, "kvwire_pd_transfers_completed_total") >= 3
        assert metric(decode, "kvwire_pd_load_failures_total") == 0  # D loaded P's KV: no recompute
        assert metric(decode, 'kvwire_kv_peers{transport="ipc"}') >= 1
    finally:
        with contextlib.suppress(ProcessLookupError):  # `kvwire up` already exited: keep its error
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        sink.close()
        print(log.read_text()[-3000:])
