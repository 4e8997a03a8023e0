"""Per-request KV transfer bytes and time between built-in engines of different tensor-parallel
sizes (P TP -> D TP), push or pull mode, loopback, in one run with the symmetric 1 -> 1 baseline.

For each topology: the same prompts go through P (prefill, 1 token) and D (loads the KV, decodes 1
token). Bytes are counted by every rank's worker connector (rank 0 in-process, the others through
the engine's rank stats) and compared with the KV size D holds for those prompts (all ranks);
time is D's time to first token (request added on both sides at once -> D's first token), which
includes P's prefill, and the handover (P's first token -> D's first token: what is left of the
transfer after P's forward, plus D's step that resumes the request). In pull mode D's request is
added when P's returns its params (as the router does; P is told D's endpoints): the handover is
then the whole pull. Usage::

    PYTHONPATH=src python benchmarks/tp_transfer.py [--prompts 8] [--prompt-len 256] [--mode pull]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import uuid
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.factory import RankConnectorFactory, build_connectors
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.tp.runner import TPRunner, model_config_of
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode

BLOCK = 16


def engine(tp: int, role: Role, max_len: int) -> LLMEngine:
    config = EngineConfig(model="tiny", dtype="float32", block_size=BLOCK, max_model_len=max_len,
                          num_kv_blocks=1024, tensor_parallel_size=tp)  # fmt: skip
    info = EngineInfo(block_size=BLOCK, tp_size=tp, num_kv_heads=model_config_of(config).num_kv_heads)
    cc = ConnectorConfig(role=role, deadline_s=60.0, lease_s=60.0)
    sched, worker = build_connectors(cc, info, registry=CollectorRegistry())
    return LLMEngine(config, sched, worker, worker_connector_factory=RankConnectorFactory(cc, info))


def rank_bytes(e: LLMEngine, name: str) -> int:
    total = int(getattr(e.worker_connector, name))
    if isinstance(e.runner, TPRunner):
        total += sum(s[name] for s in e.runner.worker_stats())
    return total


def measure(p_tp: int, d_tp: int, prompts: list[list[int]], mode: TransferMode) -> dict[str, Any]:
    max_len = max(len(p) for p in prompts) + 8
    p, d = engine(p_tp, Role.PREFILL, max_len), engine(d_tp, Role.DECODE, max_len)
    try:
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        p_eps = list(p.scheduler_connector.kv_endpoints)  # type: ignore[attr-defined]
        d_eps = list(d.scheduler_connector.kv_endpoints)  # type: ignore[attr-defined]
        ttft: list[float] = []
        handover: list[float] = []  # P's first token -> D's first token: transfer tail + D's resume
        for i, prompt in enumerate(prompts):  # one request at a time: per-request figures
            tid = uuid.uuid4().hex
            start = time.perf_counter()
            p.add_request(f"p{i}", prompt, first, KVTransferParams(
                transfer_id=tid, role=Role.PREFILL, mode=mode, peer_endpoints=d_eps).to_dict())  # fmt: skip
            if mode is TransferMode.PUSH:
                d.add_request(f"d{i}", prompt, first, KVTransferParams(
                    transfer_id=tid, role=Role.DECODE, peer_endpoints=p_eps).to_dict())  # fmt: skip
            done = False
            p_done = start
            while not done or p.has_unfinished_requests():
                for out in p.step():
                    if out.request_id == f"p{i}" and out.new_token_ids:
                        p_done = time.perf_counter()
                    if out.request_id == f"p{i}" and out.finished and mode is TransferMode.PULL:
                        d.add_request(f"d{i}", prompt, first, out.kv_transfer_params)
                for out in d.step():
                    if out.finished:
                        assert out.error is None, out.error
                        ttft.append(time.perf_counter() - start)
                        handover.append(time.perf_counter() - p_done)
                        done = True
        cfg = model_config_of(p.config)
        d_heads = max(1, cfg.num_kv_heads // d_tp) * d_tp  # heads D holds over its ranks
        kv_bytes = sum(cfg.num_layers * 2 * math.ceil(len(x) / BLOCK) * BLOCK * d_heads * cfg.head_dim * 4
                       for x in prompts)  # fmt: skip
        return {
            "sent": rank_bytes(p, "bytes_sent"), "received": rank_bytes(d, "bytes_received"),
            "kv": kv_bytes, "ttft": ttft, "handover": handover,
            "recomputes": d.stats().num_kv_load_recomputes,
        }  # fmt: skip
    finally:
        p.close()
        d.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default="push")
    args = parser.parse_args()
    mode = TransferMode(args.mode)
    torch.set_num_threads(1)
    prompts = [[(7 * j + 13 * i) % 250 + 1 for j in range(args.prompt_len)] for i in range(args.prompts)]
    print(f"tiny preset (4 layers, 2 KV heads x 32, fp32), {args.prompts} prompts x {args.prompt_len} "
          f"tokens, {mode.value} over loopback, one request at a time")  # fmt: skip
    print(f"{'P TP -> D TP':>13} {'KV/req KiB':>11} {'sent/req KiB':>13} {'recv/req KiB':>13} {'sent/KV':>8} "
          f"{'D TTFT p50 ms':>14} {'min ms':>7} {'handover p50 ms':>16} {'min ms':>7}")  # fmt: skip
    for p_tp, d_tp in ((1, 1), (1, 2), (2, 1), (2, 2)):
        r = measure(p_tp, d_tp, prompts, mode)
        n = len(prompts)
        print(f"{f'{p_tp} -> {d_tp}':>13} {r['kv'] / n / 1024:>11.1f} {r['sent'] / n / 1024:>13.1f} "
              f"{r['received'] / n / 1024:>13.1f} {r['sent'] / r['kv']:>8.3f} "
              f"{statistics.median(r['ttft']) * 1e3:>14.1f} {min(r['ttft']) * 1e3:>7.1f} "
              f"{statistics.median(r['handover']) * 1e3:>16.1f} {min(r['handover']) * 1e3:>7.1f}"
              + (f"  ({r['recomputes']} recomputed!)" if r["recomputes"] else ""))  # fmt: skip


if __name__ == "__main__":
    main()
