"""A small deterministic engine with the ``LLMEngine`` interface, and a server around it, for the
server unit tests (their fixtures are in tests/unit/server/conftest.py).

It lets tests drive what the real engine cannot be made to do on demand (a failing step, an error
output, a slow step, a step that hangs until the test releases it). Integration tests
(tests/integration/test_server*.py) use the real engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp.test_utils import TestClient, TestServer

from kvwire.engine import SamplingParams
from kvwire.engine.outputs import EngineStats, RequestOutput
from kvwire.engine.tokenizer import ByteTokenizer
from kvwire.errors import InvalidRequestError, RankLost
from kvwire.protocol.kv_params import KVTransferParams
from kvwire.server.app import ServerApp
from kvwire.server.engine_loop import EngineLoop
from kvwire.server.generate import GenerationHandler
from kvwire.server.metrics import ServerMetrics
from kvwire.supervision import HealthBoard

BLOCK_SIZE = 4
ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
STEP_GATE_TIMEOUT_S = 30.0  # a gated step that is never released fails instead of hanging the run


@dataclasses.dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    kv_params: dict[str, Any] | None
    out: list[int] = dataclasses.field(default_factory=list)


class FakeEngine:
    """Emits one token per step per request: ALPHABET[(prompt[-1] + i) % 26] for output token i."""

    model_name = "fake"
    max_model_len = 64
    num_kv_layers = 1

    def __init__(self, num_blocks: int = 256) -> None:
        self.tokenizer = ByteTokenizer()
        self.num_blocks = num_blocks
        self.reqs: dict[str, _Req] = {}
        self.fail_next_step = False
        self.error_output_for: set[str] = set()
        self.step_delay_s = 0.0
        # When set, every step waits until the event is set (a hung GPU op); step_blocked tells when.
        self.step_gate: threading.Event | None = None
        self.step_blocked = threading.Event()
        self.thread_ids: set[int] = set()
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: dict[str, Any] | None = None) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self.reqs:
            raise InvalidRequestError(f"duplicate {request_id}")
        self.reqs[request_id] = _Req(list(prompt_token_ids), params, kv_transfer_params)

    def abort_request(self, request_id: str) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        gate = self.step_gate
        if gate is not None and not gate.is_set():
            self.step_blocked.set()
            if not gate.wait(STEP_GATE_TIMEOUT_S):
                raise RuntimeError(f"step gate not released within {STEP_GATE_TIMEOUT_S} s")
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        return [self._advance(rid) for rid in list(self.reqs)]

    def _advance(self, request_id: str) -> RequestOutput:
        req = self.reqs[request_id]
        token = ALPHABET[(req.prompt[-1] + len(req.out)) % len(ALPHABET)]
        req.out.append(token)
        error = request_id in self.error_output_for
        finished = error or len(req.out) >= req.params.max_tokens
        if finished:
            del self.reqs[request_id]
        return RequestOutput(
            request_id=request_id, new_token_ids=[token], token_ids=list(req.out),
            new_text=chr(token), text=bytes(req.out).decode(), finished=finished,
            finish_reason=("error" if error else "length") if finished else None,
            error="injected" if error else None, num_prompt_tokens=len(req.prompt),
            # the params the engine got (typed: the server parses them once, at its edge)
            kv_transfer_params={"echo": _wire(req.kv_params)} if finished and req.kv_params else None,
        )

    def blocks_in_use(self) -> int:
        return sum(-(-(len(r.prompt) + len(r.out)) // BLOCK_SIZE) for r in self.reqs.values())

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.reqs), num_waiting=0, num_waiting_for_remote_kv=0,
            kv_blocks_in_use=self.blocks_in_use(), kv_blocks_total=self.num_blocks, num_preemptions=0,
            num_kv_load_failures=0, num_kv_load_recomputes=0, num_delayed_free_requests=0,
            num_prefix_cache_hit_tokens=0, num_prompt_tokens=0, num_generation_tokens=0, num_steps=0,
        )


def sse_payloads(raw: bytes) -> list[Any]:
    """Parse an SSE body strictly: every event is `data: ...` followed by a blank line."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


async def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``cond`` on the event loop until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@dataclasses.dataclass
class FakeServer:
    engine: FakeEngine
    engine_loop: EngineLoop
    generation: GenerationHandler
    client: TestClient


async def start_fake_server(
    engine: FakeEngine, accepts_kv: bool = True, client_write_timeout_s: float = 30.0,
    engine_stall_timeout_s: float | None = None, on_lost: Callable[[RankLost], None] | None = None,
    max_waiting_requests: int = 0, board: HealthBoard | None = None, max_request_bytes: int = 1 << 20,
    body_timeout_s: float = 30.0,
) -> FakeServer:
    engine_loop = EngineLoop(engine, stall_timeout_s=engine_stall_timeout_s, on_lost=on_lost)
    metrics = ServerMetrics(lambda: engine_loop.stats, engine_loop.status)
    generation = GenerationHandler(engine_loop, engine.tokenizer, metrics, engine.model_name,
                                   engine.max_model_len, accepts_kv_transfer_params=accepts_kv,
                                   client_write_timeout_s=client_write_timeout_s,
                                   max_waiting_requests=max_waiting_requests, body_timeout_s=body_timeout_s)
    app = ServerApp(engine_loop, generation, metrics, engine.model_name, engine.max_model_len, board=board)
    engine_loop.start(asyncio.get_running_loop())
    client = TestClient(TestServer(app.build(max_request_bytes)))
    await client.start_server()
    return FakeServer(engine, engine_loop, generation, client)


async def stop_fake_server(server: FakeServer) -> None:
    await server.client.close()
    assert server.engine_loop.close(5.0)


def _wire(params: object) -> object:
    """Typed params as the JSON object they came from (only the fields the client set)."""
    if isinstance(params, KVTransferParams):
        full = msgspec.to_builtins(params)
        default = msgspec.to_builtins(KVTransferParams(transfer_id=params.transfer_id, role=params.role))
        return {k: v for k, v in full.items() if k in ("transfer_id", "role") or default.get(k) != v}
    return params
