"""No client-chosen KV parameters (decision 124): the router drops a client's ``kv_transfer_params``
on every path. Real router + 1P1D ``kvwire serve`` processes, ``kv_aware``, no secret (the default,
where instances obey unsigned parameters): trap parameters naming a listening socket are sent twice,
the second time as a prefix hit that skips P (D gets the client's request alone); nothing ever
connects to the trap, and both answers are correct."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwire.cluster.local import ClusterSpec, http_json
from support.pd_cluster_helpers import BLOCK, body, metric, running_cluster, send_all
from support.waiting import wait_for

pytestmark = pytest.mark.slow
MAX_TOKENS = 4


class Trap:
    """A loopback listener that records every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.connections: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="trap", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections.append(peer)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def trap() -> Iterator[Trap]:
    t = Trap()
    yield t
    t.close()


def _trap_params(port: int, n: int) -> dict[str, Any]:
    """Decode-side pull parameters: an instance that obeyed them would connect to the trap to pull."""
    return {"transfer_id": "trap", "mode": "pull", "role": "decode", "deadline_s": 5.0,
            "peer_endpoints": [f"tcp://127.0.0.1:{port}"], "peer_instance_id": "trap",
            "first_token_id": 1, "num_prompt_tokens": n}


def _d_cached_blocks(router_url: str) -> int:
    return sum(i["kv_cache"]["cached_blocks"] for i in http_json(f"{router_url}/instances")
               if i["role"] == "decode")


def test_trap_kv_params_never_reach_an_instance(tmp_path: Path, trap: Trap) -> None:
    spec = ClusterSpec(num_prefill=1, num_decode=1, heartbeat_interval_s=0.5, kv_deadline_s=10.0,
                       router_args=("--policy", "kv_aware"))
    prompt = [(7 * j) % 250 + 1 for j in range(200)]
    with running_cluster(spec, tmp_path / "cluster.log") as cluster:
        url = cluster.router_url
        answers = []
        for k in range(2):
            if k:  # D holds the prompt now (KV events): the router skips P and sends D the request
                need = (len(prompt) + MAX_TOKENS) // BLOCK - 1
                wait_for(lambda n=need: _d_cached_blocks(url) >= n, 30, "D's KV events at the router")
            request = body(prompt, stream=k == 1, max_tokens=MAX_TOKENS)
            request["kv_transfer_params"] = _trap_params(trap.port, len(prompt))
            (result,) = send_all(url, [request])
            assert result.ok, result.error
            answers.append(result.token_ids)
        assert trap.connections == []  # no instance obeyed the client's parameters
        assert metric(url, "kvwire_router_skipped_prefills_total") == 1  # the second went to D alone
        assert metric(url, "kvwire_router_client_kv_params_dropped_total") == 2
        assert answers[0] == answers[1] and len(answers[0]) == MAX_TOKENS
        decode = next(i for i in cluster.live_instances() if i.role == "decode")
        assert decode.url is not None
        assert metric(decode.url, "kvwire_pd_load_failures_total") == 0
    assert trap.connections == []
