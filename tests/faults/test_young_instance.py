"""An instance that registers before its HTTP server listens (the vLLM plugin did): a request sent
to the router meanwhile is held briefly (bounded) for that young instance instead of failing with 503."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kvwire.cluster.local import free_port
from kvwire.cluster.process import ManagedProcess, kvwire_argv, wait_until
from kvwire.discovery import HeartbeatClient, InstanceInfo
from kvwire.protocol.kv_params import Role
from support.fault_cluster import post_json

pytestmark = pytest.mark.slow
ANSWER = {"id": "cmpl-y", "object": "text_completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}]}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        data = json.dumps(ANSWER).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def router() -> Iterator[tuple[str, str]]:
    http_port, disc_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    argv = kvwire_argv("router", "--host", "127.0.0.1", "--port", str(http_port), "--discovery-host",
                       "127.0.0.1", "--discovery-port", str(disc_port))
    proc = ManagedProcess("router", argv, sink=sys.stderr, sink_lock=threading.Lock())
    url = f"http://127.0.0.1:{http_port}"
    try:
        assert wait_until(lambda: _listening(http_port), 30)
        yield url, f"tcp://127.0.0.1:{disc_port}"
    finally:
        proc.stop(5.0)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_request_waits_for_an_instance_that_registered_before_listening(router: tuple[str, str]) -> None:
    url, discovery = router
    port = free_port("127.0.0.1")
    info = InstanceInfo(instance_id="young", role=Role.BOTH, url=f"http://127.0.0.1:{port}",
                        model="m")
    client = HeartbeatClient(discovery, info, interval_s=0.2).start()  # registers before listening
    server: http.server.HTTPServer | None = None
    try:
        assert wait_until(lambda: _listed(url), 10)
        result: list[tuple[int, object]] = []
        sender = threading.Thread(target=lambda: result.append(
            post_json(url + "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1})), daemon=True)
        sender.start()
        time.sleep(1.0)  # the instance starts listening a second later (the fault under test)
        server = http.server.HTTPServer(("127.0.0.1", port), _Handler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        sender.join(10)
        assert result and result[0][0] == 200, result
    finally:
        client.close()
        if server is not None:
            server.shutdown()
            server.server_close()


def _listed(url: str) -> bool:
    with urllib.request.urlopen(url + "/instances", timeout=5) as resp:
        return any(e["id"] == "young" and e["alive"] for e in json.loads(resp.read()))
