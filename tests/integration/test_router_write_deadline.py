"""A client that stops reading (its connection left open) is cut off by the router after
``client_write_timeout_s``, streaming or not: the upstream calls still in flight see the disconnect (so
the instances abort the request), the request is counted as ``client_timeout``, the router holds
nothing for it and keeps serving others (colocated and P/D push)."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvwire.errors import ConfigError
from kvwire.router.cli import add_arguments, config_from_args
from kvwire.router.config import RouterConfig
from support.http_client import read_slowly
from support.mock_instance import PD_AND_SOLO, MockCluster, RouterThread, get_raw, post
from support.waiting import wait_for

WRITE_TIMEOUT_S = 0.5
# Tokens in a non-streaming answer: about 12 MB of JSON, more than the stalled client's 4 KiB window,
# the router's loopback send buffer (4 MiB at most here) and its transport buffer together.
BIG_MAX_TOKENS = 1_500_000


@pytest.fixture(scope="module")
def setup() -> Iterator[MockCluster]:
    s = MockCluster(PD_AND_SOLO, client_write_timeout_s=WRITE_TIMEOUT_S)
    try:
        yield s
    finally:
        s.close()


def _stalled_client(url: str, body: dict[str, Any]) -> socket.socket:
    """Send a request over a socket with a tiny receive buffer that is then never read."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.settimeout(5)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def _timeouts(router: RouterThread) -> float:
    _, text = get_raw(router.url, "/metrics")
    for line in text.decode().splitlines():
        if line.startswith("kvwire_router_requests_total{") and 'outcome="client_timeout"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(("model", "upstream"), [("solo", "b0"), ("mock", "d0")])
def test_stalled_client_is_cut_off_and_the_upstream_sees_the_disconnect(
    setup: MockCluster, model: str, upstream: str
) -> None:
    mock = setup.mocks[upstream]
    before_disconnects = len(mock.stats()["disconnects"])
    before_timeouts = _timeouts(setup.router)
    # 32 KiB per event, 2 ms apart, 5000 events: the upstream would stream for > 10 s.
    body = {"model": model, "prompt": "chunk_kb=32 gap_ms=2", "max_tokens": 5000, "stream": True}
    sock = _stalled_client(setup.router.url, body)
    try:
        started = time.monotonic()
        # Without a write deadline the router's relay parks in drain() and the upstream streams on.
        wait_for(lambda: len(mock.stats()["disconnects"]) > before_disconnects, 8,
                 f"{upstream} to see the client's request cancelled")
        assert time.monotonic() - started < 8
        assert mock.stats()["disconnects"][-1]["body"]["stream"] is True
        wait_for(lambda: _timeouts(setup.router) == before_timeouts + 1, 5, "a client_timeout outcome")
        _assert_still_serves(setup.router, model)
    finally:
        sock.close()


def _assert_still_serves(router: RouterThread, model: str) -> None:
    """After a client was cut off, the next request to ``model`` is answered in full."""
    status, answer = post(router.url, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 3})
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["text"] == " t0 t1 t2"


def _inflight(router: RouterThread) -> float:
    _, text = get_raw(router.url, "/metrics")
    for line in text.decode().splitlines():
        if line.startswith("kvwire_router_inflight_requests "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvwire_router_inflight_requests in /metrics")


@pytest.mark.parametrize(("model", "prompt", "cancelled"), [
    ("solo", "hi", None),  # colocated: the instance has answered; the router must still let go
    ("mock", "prefill.hang", "p0"),  # push: D has answered, P still runs and must be cancelled
])
def test_stalled_client_of_a_non_streaming_answer_is_cut_off(
    setup: MockCluster, model: str, prompt: str, cancelled: str | None
) -> None:
    before_timeouts = _timeouts(setup.router)
    before_disconnects = {name: len(m.stats()["disconnects"]) for name, m in setup.mocks.items()}
    body = {"model": model, "prompt": prompt, "max_tokens": BIG_MAX_TOKENS}
    sock = _stalled_client(setup.router.url, body)
    try:
        # Without a deadline aiohttp parks in drain() writing the body and the handler never ends.
        wait_for(lambda: _timeouts(setup.router) == before_timeouts + 1, 10, "a client_timeout outcome")
        wait_for(lambda: _inflight(setup.router) == 0, 5, "the router to let go of the request")
        if cancelled is not None:
            mock = setup.mocks[cancelled]
            wait_for(lambda: len(mock.stats()["disconnects"]) > before_disconnects[cancelled], 5,
                     f"{cancelled} to see its request cancelled")
            assert mock.stats()["disconnects"][-1]["body"]["max_tokens"] == 1  # P's copy
        _assert_still_serves(setup.router, model)
    finally:
        sock.close()


def test_slow_reader_of_a_large_answer_gets_all_of_it(setup: MockCluster) -> None:
    # Each pause is shorter than the deadline, the whole read (over 1 s) much longer: the deadline
    # bounds one piece of the body, not the whole body.
    body = {"model": "solo", "prompt": "hi", "max_tokens": BIG_MAX_TOKENS}
    sock = _stalled_client(setup.router.url, body)
    sock.settimeout(20)
    try:
        head, payload = read_slowly(sock, pause_s=WRITE_TIMEOUT_S / 5, every_bytes=1024 * 1024)
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    text = json.loads(payload)["choices"][0]["text"]
    assert text == "".join(f" t{i}" for i in range(BIG_MAX_TOKENS))


def test_write_timeout_is_configurable_and_validated() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).client_write_timeout_s == 30.0
    cfg = config_from_args(parser.parse_args(["--client-write-timeout-s", "2.5"]))
    assert cfg.client_write_timeout_s == 2.5
    with pytest.raises(ConfigError, match="client_write_timeout_s"):
        RouterConfig(client_write_timeout_s=0)
