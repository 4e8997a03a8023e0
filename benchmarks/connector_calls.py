"""Calls from the built-in engine into the KV connector on D, per engine step and per request.

Two built-in engines (the ``tiny`` preset, 4 layers) in this process, joined by the real connector
halves and transfer agents on loopback; one request in push mode with P's first token. D is stepped
under ``sys.setprofile`` from ``add_request`` to its first token, then for ``DECODE_TOKENS`` decode
steps; every call whose caller is a module of ``kvwire.engine`` and whose callee is a module of
``kvwire.connector`` is counted by call site (constructors of the plan's dataclasses left out). D's
number of steps to the first token depends on when the transfer lands, so the table gives calls per
D step and calls made for the request (``ONCE``), then calls per decode step.

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
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import KVTransferParams, Role

BLOCK = 16
DECODE_TOKENS = 4
# hooks the engine calls for one request, not in every step (before and after decision 131)
ONCE = ("get_num_new_matched_tokens", "update_state_after_alloc", "take_first_token", "request_finished")


def engine(role: Role) -> tuple[LLMEngine, list[str]]:
    """A built-in engine with the P/D connector for ``role``, and its KV endpoints."""
    config = EngineConfig(model="tiny", block_size=BLOCK, max_model_len=256, num_kv_blocks=64)
    connector = ConnectorConfig(role=role, deadline_s=30.0, lease_s=30.0)
    sched, worker = build_connectors(connector, EngineInfo(block_size=BLOCK), registry=CollectorRegistry())
    return LLMEngine(config, sched, worker), list(sched.kv_endpoints)


def counter() -> tuple[collections.Counter[str], Any]:
    """A call-site counter and the profile function that fills it."""
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

    return counts, profile


def step_traced(engine: LLMEngine, profile: Any) -> list[Any]:
    sys.setprofile(profile)
    try:
        return engine.step()
    finally:
        sys.setprofile(None)


def main() -> None:
    (p, p_endpoints), (d, d_endpoints) = engine(Role.PREFILL), engine(Role.DECODE)
    tid, prompt = uuid.uuid4().hex, list(range(1, 41))
    sides = ((p, d_endpoints, Role.PREFILL, 1), (d, p_endpoints, Role.DECODE, 64))
    for host, peer_endpoints, role, max_tokens in sides:
        params = KVTransferParams(transfer_id=tid, role=role, peer_endpoints=peer_endpoints)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        host.add_request(role.value, prompt, sampling, params)
    first_counts, profile = counter()
    steps, first, deadline = 0, False, time.monotonic() + 60.0
    while not first and time.monotonic() < deadline:
        p.step()
        steps += 1
        first = any(o.request_id == Role.DECODE.value and o.new_token_ids for o in step_traced(d, profile))
    if not first:
        raise SystemExit("D produced no first token within 60 s")
    decode_counts, profile = counter()
    for _ in range(DECODE_TOKENS):
        step_traced(d, profile)
    p.close()
    d.close()
    print(f"D: {steps} steps to the first token, then {DECODE_TOKENS} decode steps; engine -> connector")
    print(f"{'call site':68} {'per step':>8} {'once':>5} {'per decode step':>16}")
    totals = [0, 0, 0]
    for site in sorted(set(first_counts) | set(decode_counts)):
        n, m = first_counts[site], decode_counts[site]
        once = site.endswith(ONCE)
        row = [0 if once else n // steps, n if once else 0, m // DECODE_TOKENS]
        totals = [t + r for t, r in zip(totals, row, strict=True)]
        print(f"{site:68} {row[0]:>8} {row[1]:>5} {row[2]:>16}")
    print(f"{'total':68} {totals[0]:>8} {totals[1]:>5} {totals[2]:>16}")


if __name__ == "__main__":
    main()
