"""Calls from the built-in engine into the KV connector on D, per engine step and per request.

Two built-in engines (the ``tiny`` preset) in this process, joined by the real connector halves and
transfer agents on loopback; one request in push mode with P's first token. D is stepped under
``sys.setprofile`` from ``add_request`` to its first token; every call whose caller is a module of
``kvwire.engine`` and whose callee is a module of ``kvwire.connector`` is counted by call site
(constructors of the plan's dataclasses left out). D's number of steps depends on when the transfer
lands, so the table gives calls per D step and calls per request (those made once).

Usage: ``PYTHONPATH=src python benchmarks/connector_calls.py`` (runs in a few seconds on a CPU).
"""

from __future__ import annotations

import collections
import sys
import time
import types
import uuid
from typing import Any

from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.factory import build_connectors
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.sampling_params import SamplingParams
from kvwire.kv_params import KVTransferParams, Role

BLOCK = 16


def engine(role: Role) -> LLMEngine:
    config = EngineConfig(model="tiny", block_size=BLOCK, max_model_len=256, num_kv_blocks=64)
    connector = ConnectorConfig(role=role, deadline_s=30.0, lease_s=30.0)
    sched, worker = build_connectors(connector, EngineInfo(block_size=BLOCK), registry=CollectorRegistry())
    return LLMEngine(config, sched, worker)


def main() -> None:
    p, d = engine(Role.PREFILL), engine(Role.DECODE)
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        del arg
        back = frame.f_back
        if event != "call" or back is None or frame.f_code.co_name == "__init__":
            return
        caller, callee = back.f_globals.get("__name__", ""), frame.f_globals.get("__name__", "")
        if caller.startswith("kvwire.engine") and callee.startswith("kvwire.connector"):
            site = f"{caller.removeprefix('kvwire.')} -> {callee.removeprefix('kvwire.')}"
            counts[f"{site}.{frame.f_code.co_name}"] += 1

    tid, prompt = uuid.uuid4().hex, list(range(1, 41))
    endpoints = {e: list(e.scheduler_connector.kv_endpoints) for e in (p, d)}  # type: ignore[attr-defined]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for rid, (host, peer, role) in {"p": (p, d, Role.PREFILL), "d": (d, p, Role.DECODE)}.items():
        params = KVTransferParams(transfer_id=tid, role=role, peer_endpoints=endpoints[peer])
        host.add_request(rid, prompt, one, params)
    steps, first, deadline = 0, False, time.monotonic() + 60.0
    while not first and time.monotonic() < deadline:
        p.step()
        sys.setprofile(profile)
        outputs = d.step()
        sys.setprofile(None)
        steps += 1
        first = any(o.request_id == "d" and o.new_token_ids for o in outputs)
    p.close()
    d.close()
    if not first:
        raise SystemExit("D produced no first token within 60 s")
    print(f"D: {steps} steps to the first token; engine -> connector calls")
    print(f"{'call site':72} {'per step':>9} {'per request':>12}")
    per_step = per_request = 0
    for site, n in sorted(counts.items()):
        once = n < steps
        per_request += n if once else 0
        per_step += 0 if once else n // steps
        print(f"{site:72} {'' if once else n // steps:>9} {n if once else '':>12}")
    print(f"{'total':72} {per_step:>9} {per_request:>12}")


if __name__ == "__main__":
    main()
