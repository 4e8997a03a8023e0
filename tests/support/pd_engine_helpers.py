"""Shared settings of the engine-level P/D tests (two built-in engines and their connectors in one
process)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
from kvwire.connector.factory import build_connectors
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from kvwire.transfer.config import ControlLimits, TransferConfig

# P alive but never given the request (the tests' "P lost"): its agent answers "unknown", which renews
# D's lease for max_admission_wait_s (decision 128, 30 s by default: a request still in P's HTTP
# server). The tests of D's recovery from a lost P pin the wait to 0 to test the lease itself.
NO_ADMISSION_WAIT = TransferConfig(limits=ControlLimits(max_admission_wait_s=0.0))

BLOCK = 16
MAX_TOKENS = 8
MAX_LEN = 256


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def engine_config(**overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(model="tiny", block_size=BLOCK, max_model_len=MAX_LEN, num_kv_blocks=256)
    base.update(overrides)
    return EngineConfig(**base)


class PD:
    """A prefill engine and a decode engine joined by the kvwire connector, stepped in turn."""

    def __init__(
        self,
        *,
        p_config: EngineConfig,
        d_config: EngineConfig,
        deadline_s: float = 30.0,
        policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE,
        transfer: TransferConfig | None = None,
    ) -> None:
        def pair(role: Role, config: EngineConfig) -> LLMEngine:
            cc = ConnectorConfig(
                role=role, deadline_s=deadline_s, lease_s=deadline_s, kv_load_failure_policy=policy,
                transfer=transfer,
            )
            sched, worker = build_connectors(cc, EngineInfo(block_size=BLOCK), registry=CollectorRegistry())
            return LLMEngine(config, sched, worker)

        self.p = pair(Role.PREFILL, p_config)
        self.d = pair(Role.DECODE, d_config)
        self.deadline_s = deadline_s
        self.results: dict[str, Any] = {}

    def endpoints(self, engine: LLMEngine) -> list[str]:
        return list(engine.scheduler_connector.kv_endpoints)  # type: ignore[attr-defined]

    def add_push(self, rid: str, prompt: list[int], *, to_p: bool = True) -> str:
        tid = uuid.uuid4().hex
        if to_p:
            p_params = KVTransferParams(
                transfer_id=tid,
                role=Role.PREFILL,
                deadline_s=self.deadline_s,
                peer_endpoints=self.endpoints(self.d),
            )
            self.p.add_request("p-" + rid, prompt, FIRST, p_params.to_dict())
        d_params = KVTransferParams(
            transfer_id=tid,
            role=Role.DECODE,
            deadline_s=self.deadline_s,
            peer_endpoints=self.endpoints(self.p),
        )
        self.d.add_request(rid, prompt, GREEDY, d_params.to_dict())
        return tid

    def add_pull_p(self, rid: str, prompt: list[int]) -> None:
        params = KVTransferParams(
            transfer_id=uuid.uuid4().hex,
            mode=TransferMode.PULL,
            role=Role.PREFILL,
            deadline_s=self.deadline_s,
        )
        self.p.add_request("p-" + rid, prompt, FIRST, params.to_dict())

    def step(self) -> None:
        for out in self.p.step():
            if out.finished:
                self.results["p-" + out.request_id[2:]] = out
        for out in self.d.step():
            if out.finished:
                self.results[out.request_id] = out

    def run(self, timeout_s: float = 60.0, until: Any = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if until is not None and until():
                return
            if until is None and not (self.p.has_unfinished_requests() or self.d.has_unfinished_requests()):
                return
            self.step()
            time.sleep(0.0005)
        raise AssertionError("P/D engines did not finish before the deadline")

    def close(self) -> None:
        self.p.close()
        self.d.close()


