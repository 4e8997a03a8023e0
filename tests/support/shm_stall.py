"""A prefill process stalled in the middle of a one-copy layer while D gives up on the transfer and
serves other requests (decision 114; used by test_shm_revoke_stall.py, which also runs it 100 times).

P is a child process (shm_stall_prefill.py) whose writer stops itself (SIGSTOP, the plane's test
hook) half way through layer ``STALL_LAYER`` of every transfer, holding the grant; D is a built-in
engine in this process. One iteration: request A goes P -> D; P stops mid-layer; D's receive times
out and its revoke wait runs out; D takes two local requests B1 and B2 while A is still failed;
once both computed their prompts (and D's cache is full: with A's blocks back in the pool, B2 would
sit in them), P is resumed and finishes the layer it was copying; then D runs everything to the end
and every output is compared with a colocated engine's. Before decision 114, D freed A's blocks
when the revoke wait ran out, B2 took them and P's late write landed in B2's KV.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.factory import build_connectors
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import KVTransferParams, Role
from kvwire.transfer.planes.shm.plane import STOP_MID_LAYER_ENV

BLOCK = 16
PROMPT = 40  # 3 blocks, and with MAX_TOKENS no request needs a 4th: D's blocks are exactly planned
MAX_TOKENS = 8
STALL_LAYER = 1  # of the tiny model's 4
DEADLINE_S = 1.0  # D's receive lease: how long D waits for the stalled P
# D's blocks: A (3, held while quarantined), A recomputed (3) and B1 (3) from the front of the free
# list; B2's 3 are then A's old blocks, which the free list hands out last (least recently freed)
D_BLOCKS = 9
WAIT_S = 60.0  # every wait of an iteration (generous: a loaded 2-core box)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CHILD = Path(__file__).with_name("shm_stall_prefill.py")


def prompts(iteration: int) -> dict[str, list[int]]:
    """A, B1, B2 of one iteration: distinct prompts (no prefix-cache hits between them)."""
    rng = random.Random(iteration)
    names = (f"a{iteration}", f"b1_{iteration}", f"b2_{iteration}")
    return {name: [rng.randrange(1, 250) for _ in range(PROMPT)] for name in names}


def colocated(all_prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every prompt's greedy output on one engine without P/D: the reference."""
    engine = LLMEngine(EngineConfig(model="tiny", block_size=BLOCK, max_model_len=256))
    try:
        for rid, prompt in all_prompts.items():
            engine.add_request(rid, prompt, GREEDY)
        out: dict[str, list[int]] = {}
        deadline = time.monotonic() + 10 * WAIT_S
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the colocated reference did not finish"
            out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return out
    finally:
        engine.close()


class Prefill:
    """The P child process, driven by JSON lines. ``close`` resumes and kills it."""

    def __init__(self) -> None:
        env = dict(os.environ, **{STOP_MID_LAYER_ENV: str(STALL_LAYER)})
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(BLOCK), str(DEADLINE_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )  # fmt: skip
        self.endpoints: list[str] = self._read(WAIT_S * 2)["endpoints"]

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise AssertionError(f"the prefill process said nothing for {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the prefill process exited (rc={self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(WAIT_S)

    def stopped(self) -> bool:
        """The process is stopped (its writer's SIGSTOP), by /proc."""
        with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=WAIT_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@dataclasses.dataclass
class Tally:
    iterations: int = 0
    outputs: int = 0
    differing: list[str] = dataclasses.field(default_factory=list)
    quarantined: int = 0  # iterations where D held A's blocks back while P was stopped
    late_writes: int = 0  # layers P finished writing after being resumed (D had given up on them)


class Decode:
    """D: a built-in engine with the P/D connector in this process, stepped by the test."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        config = ConnectorConfig(role=Role.DECODE, deadline_s=DEADLINE_S, lease_s=DEADLINE_S)
        sched, worker = build_connectors(config, EngineInfo(block_size=BLOCK), registry=self.registry)
        engine = EngineConfig(model="tiny", block_size=BLOCK, max_model_len=256, num_kv_blocks=D_BLOCKS)
        self.engine = LLMEngine(engine, sched, worker)
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    def step_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")
            for out in self.engine.step():
                self.tokens[out.request_id] = out.token_ids
                if out.finished:
                    self.finished.add(out.request_id)
            time.sleep(0.001)  # the stepping loop's pace, not a synchronization

    def recv_failures(self) -> float:
        """D's failed receives so far (the connector's counter)."""
        families = [m for m in self.registry.collect() if m.name == "kvwire_pd_transfers_failed"]
        samples = [s for m in families for s in m.samples]
        return sum(s.value for s in samples if s.name.endswith("_total") and s.labels["side"] == "recv")

    def quarantined_blocks(self) -> int:
        return int(getattr(self.engine.worker_connector, "num_quarantined_blocks", 0))

    def close(self) -> None:
        self.engine.close()


def iteration(i: int, p: Prefill, d: Decode, reference: dict[str, list[int]], tally: Tally) -> None:
    a, b1, b2 = prompts(i).items()
    tid = uuid.uuid4().hex
    p_params = KVTransferParams(
        transfer_id=tid, role=Role.PREFILL, deadline_s=DEADLINE_S, peer_endpoints=d_endpoints(d)
    )
    d_params = KVTransferParams(
        transfer_id=tid, role=Role.DECODE, deadline_s=DEADLINE_S, peer_endpoints=p.endpoints
    )
    failures = d.recv_failures()
    p.call("add", rid="p-" + a[0], prompt=a[1], params=p_params.to_dict())
    d.engine.add_request(a[0], a[1], GREEDY, d_params.to_dict())
    d.step_until(p.stopped, f"P to stop in the middle of layer {STALL_LAYER} (iteration {i})")
    d.step_until(lambda: d.recv_failures() > failures, "D's receive to time out")
    for rid, prompt in (b1, b2):
        d.engine.add_request(rid, prompt, GREEDY)
    d.step_until(lambda: all(d.tokens.get(rid) for rid, _ in (b1, b2)), "B1 and B2 to compute their prompts")
    tally.quarantined += d.quarantined_blocks() > 0
    os.kill(p.proc.pid, signal.SIGCONT)  # P finishes the layer it was copying when it stopped
    deadline = time.monotonic() + WAIT_S
    while p.call("stats")["stopped"] <= tally.late_writes:
        assert time.monotonic() < deadline, "P did not finish its stalled layer"
    tally.late_writes += 1
    rids = [a[0], b1[0], b2[0]]
    d.step_until(lambda: all(r in d.finished for r in rids), "D's requests to finish")
    tally.iterations += 1
    for rid in rids:
        tally.outputs += 1
        if d.tokens[rid] != reference[rid]:
            tally.differing.append(rid)


def d_endpoints(d: Decode) -> list[str]:
    return list(d.engine.scheduler_connector.kv_endpoints)  # type: ignore[attr-defined]
