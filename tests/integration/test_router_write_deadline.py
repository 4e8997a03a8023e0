"""A streaming client that stops reading (its connection left open) is cut off by the router after
``client_write_timeout_s``: the upstream instance sees the disconnect (so it aborts the request), the
request is counted as ``client_timeout`` and the router keeps serving others (colocated and P/D push)."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from mock_instance import PD_AND_SOLO, MockCluster, RouterThread, get_raw, post, wait_for

from kvwire.errors import ConfigError
from kvwire.router.cli import add_arguments, config_from_args
from kvwire.router.config import RouterConfig

WRITE_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def setup() -> Iterator[MockCluster]:
    s = MockCluster(PD_AND_SOLO, client_write_timeout_s=WRITE_TIMEOUT_S)
    try:
        yield s
    finally:
        s.close()


def _stalled_client(url: str, body: dict[str, Any]) -> socket.socket:
    """Send a streaming request over a socket with a tiny receive buffer that is then never read."""
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
        status, answer = post(setup.router.url, "/v1/completions", {"model": model, "prompt": "hi",
                                                                    "max_tokens": 3})
        assert status == 200, answer
        assert json.loads(answer)["choices"][0]["text"] == " t0 t1 t2"
    finally:
        sock.close()


def test_write_timeout_is_configurable_and_validated() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).client_write_timeout_s == 30.0
    cfg = config_from_args(parser.parse_args(["--client-write-timeout-s", "2.5"]))
    assert cfg.client_write_timeout_s == 2.5
    with pytest.raises(ConfigError, match="client_write_timeout_s"):
        RouterConfig(client_write_timeout_s=0)
