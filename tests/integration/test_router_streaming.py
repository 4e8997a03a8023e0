"""Streams are relayed event by event: in every mode (colocated, P/D push, push with the first token from P,
pull) each SSE event from the instance reaches the client as soon as it arrives. Guards the report that
P/D streams reached the client nearly all at once (see docs/decisions/041-router-discovery.md).

The mock streams ``N_TOKENS`` token events ``GAP_MS`` apart and records when it wrote each one; the client
(raw socket reads, no buffering) records when each event arrived. Pass-through means the events arrive
spread out like they were emitted, most of them before the last one was written, and (push) D's first
token does not wait for a prefill instance that answers late.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvwire.protocol.kv_params import TransferMode
from support.mock_instance import PD_AND_SOLO, MockCluster, MockProcess

GAP_MS = 100
N_TOKENS = 6
EMISSION_SPAN_S = GAP_MS * (N_TOKENS - 1) / 1000


@pytest.fixture(scope="module", params=["push", "push-early", "pull"])
def setup(request: pytest.FixtureRequest) -> Iterator[MockCluster]:
    mode = TransferMode.PULL if request.param == "pull" else TransferMode.PUSH
    s = MockCluster(PD_AND_SOLO, mode=mode, stream_first_token_from_prefill=request.param == "push-early")
    yield s
    s.close()


def _stream(url: str, path: str, body: dict[str, Any]) -> list[tuple[float, bytes]]:
    """POST and read the chunked SSE answer off the socket as it comes: [(arrived_at, event data)],
    wall-clock seconds (the mock's clock). Chunk framing stays in the bytes; only ``data:`` lines are read."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    events: list[tuple[float, bytes]] = []
    buf = raw = b""
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(head + data)
        while chunk := sock.recv(65536):
            now = time.time()
            raw = raw or chunk
            buf += chunk
            while (end := buf.find(b"\n\n")) >= 0:
                block, buf = buf[:end], buf[end + 2:]
                line = block[block.find(b"data: "):] if b"data: " in block else b""
                if line:
                    events.append((now, line[6:].strip()))
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    return events


def _token_arrivals(events: list[tuple[float, bytes]], chat: bool) -> list[tuple[float, str]]:
    out = []
    for at, data in events:
        if data == b"[DONE]":
            continue
        choices = json.loads(data).get("choices") or [{}]
        text = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
        if text:
            out.append((at, text))
    return out


@pytest.mark.parametrize(("plan", "slow_prefill"), [("pd", False), ("pd", True), ("colocated", False)])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_events_reach_the_client_as_they_are_emitted(
    setup: MockCluster, plan: str, slow_prefill: bool, path: str
) -> None:
    push = setup.router.server.cfg.mode is TransferMode.PUSH
    chat = path.endswith("chat/completions")
    model = "mock" if plan == "pd" else "solo"
    upstream = setup.mocks["d0" if plan == "pd" else "b0"]
    # prefill.delay: P answers 0.3 s late, after D's first tokens (a router waiting for P would hold them).
    prompt = f"streaming gap_ms={GAP_MS}" + (" prefill.delay" if slow_prefill else "")
    body: dict[str, Any] = {"model": model, "max_tokens": N_TOKENS, "stream": True}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    events = _stream(setup.router.url, path, body)
    tokens = _token_arrivals(events, chat)
    assert "".join(t for _, t in tokens) == "".join(f" t{i}" for i in range(N_TOKENS))
    assert events[-1][1] == b"[DONE]"
    emitted = _last_stream(upstream)["emitted_at"]
    assert len(emitted) == N_TOKENS
    spread = tokens[-1][0] - tokens[0][0]
    assert spread >= 0.5 * EMISSION_SPAN_S, (
        f"events arrived within {spread:.3f} s (emitted over {emitted[-1] - emitted[0]:.3f} s): held back"
    )
    # Most tokens reached the client before the mock had even written the last one.
    early = sum(at < emitted[-1] - GAP_MS / 2000 for at, _ in tokens)
    assert early >= N_TOKENS // 2, f"only {early} of {N_TOKENS} events arrived before the stream's end"
    if slow_prefill and push:  # ... and before P answered: D's stream does not wait for P (pull: P first)
        p_answered = _last_stream(setup.mocks["p0"], stream=False)["answered_at"]
        assert tokens[0][0] < p_answered, "D's first token was held until P answered"


def _last_stream(mock: MockProcess, stream: bool = True) -> dict[str, Any]:
    """The last request ``mock`` received with ``stream`` set as given."""
    return [r for r in mock.stats()["requests"] if bool(r["body"].get("stream")) is stream][-1]
