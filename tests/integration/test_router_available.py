"""Available whenever it says it is (decision 124): /v1/models lists a model only when a request for
it can be served now; with no live P, D serves alone (``--pd-fallback colocated``, the default) or
the router answers 503 (``error``); during a cluster's start-up no client that waited for
/v1/models gets a 5xx."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.protocol.kv_params import Role
from kvwire.router.config import PdFallback
from support.mock_instance import MockCluster, get, live_ids, post
from support.waiting import wait_for


@pytest.fixture
def cluster() -> Iterator[Any]:
    made: list[MockCluster] = []

    def make(*args: Any, **kw: Any) -> MockCluster:
        made.append(MockCluster(*args, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _models(url: str) -> list[str]:
    return [m["id"] for m in get(url, "/v1/models")["data"]]


def test_decode_alone_serves_when_prefill_dies_and_is_counted(cluster: Any) -> None:
    c = cluster([("p0", "prefill", ["--model", "m"]), ("d0", "decode", ["--model", "m"])])
    assert _models(c.url) == ["m"]
    c.mocks["p0"].kill()
    wait_for(lambda: "p0" not in live_ids(c.router), 20, "p0 expired")
    assert _models(c.url) == ["m"]  # D alone can serve it
    trap = {"transfer_id": "t", "mode": "pull", "role": "decode", "peer_endpoints": ["tcp://127.0.0.1:9"]}
    for stream in (False, True):
        code, data = post(c.url, "/v1/completions", {"model": "m", "prompt": "x", "stream": stream,
                                                      "max_tokens": 3, "kv_transfer_params": trap})
        assert code == 200, data
    d_bodies = [r["body"] for r in c.mocks["d0"].stats()["requests"]]
    # a plain request: the client's kv_transfer_params dropped (decision 124)
    assert len(d_bodies) == 2 and all("kv_transfer_params" not in b for b in d_bodies)
    assert c.metric("kvwire_router_pd_fallback_total") == 2


def test_fallback_error_unlists_the_model_and_answers_503(cluster: Any) -> None:
    c = cluster([("d0", "decode", ["--model", "m"])], pd_fallback=PdFallback.ERROR)
    assert _models(c.url) == []
    code, data = post(c.url, "/v1/completions", {"model": "m", "prompt": "x"})
    assert code == 503 and "--pd-fallback error" in json.loads(data)["error"]["message"]
    assert c.mocks["d0"].stats()["requests"] == []
    assert c.metric("kvwire_router_pd_fallback_total") == 0


def _poll_then_send(url: str, deadline_s: float, stop: threading.Event) -> tuple[int, str]:
    """Poll /v1/models until it lists 'tiny', then send one request at once; its status and body."""
    wait_for(lambda: stop.is_set() or _lists_tiny(url), deadline_s, "/v1/models listing tiny",
             interval_s=0.005)
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # no answer at all: as bad as a 5xx
        return 0, repr(exc)


def _lists_tiny(url: str) -> bool:
    return "tiny" in _models(url)  # the router answers by now: any failure fails the test


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(3))
def test_no_5xx_for_a_client_that_waited_for_models_during_start_up(tmp_path: Path, round_: int) -> None:
    """As ``kvwire up`` starts: the router first, then P and D (from this, the main thread: children
    die with the thread that started them); a client polls /v1/models from the moment the router
    answers and sends as soon as the model is listed."""
    with open(tmp_path / "cluster.log", "w") as sink:
        cluster = LocalCluster(ClusterSpec(start_timeout_s=240), sink=sink)
        started = threading.Event()
        answers: list[tuple[int, str]] = []
        try:
            cluster.start_router()
            url = cluster.router_url
            wait_for(lambda: _router_health(url), 120, "the router answering /health")
            client = threading.Thread(target=lambda: answers.append(_poll_then_send(url, 240, started)))
            client.start()
            cluster.start_instance("prefill-0", Role.PREFILL)
            cluster.start_instance("decode-0", Role.DECODE)
            cluster.wait_ready()
            started.set()
            client.join(240)
            assert answers, "the client thread gave no answer"
            status, text = answers[0]
            assert status == 200, (status, text, (tmp_path / "cluster.log").read_text()[-3000:])
        finally:
            started.set()
            cluster.stop()


def _router_health(url: str) -> bool:
    try:
        return "live_instances" in get(url, "/health")
    except (OSError, ValueError, AssertionError, http.client.HTTPException):
        return False
