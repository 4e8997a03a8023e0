"""Router request path against mock upstream processes: pass-through, errors, disconnects, P/D dispatch.

Routers and mocks are shared per module where a test leaves no state behind (tests compare counters
before and after), to keep process start-ups off this 2-core box.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvwire.discovery import Heartbeat, InstanceInfo, encode_frames
from kvwire.protocol.kv_params import Role, TransferMode
from kvwire.router.config import Policy
from support.mock_instance import MockCluster, MockSpec, get, live_ids, post
from support.waiting import wait_for


@pytest.fixture
def cluster() -> Iterator[Any]:
    made: list[MockCluster] = []

    def make(specs: list[MockSpec], **router_kw: Any) -> MockCluster:
        made.append(MockCluster(specs, **router_kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def single() -> Iterator[MockCluster]:
    c = MockCluster([("m0", "both", [])])
    yield c
    c.close()


def _pd_specs() -> list[MockSpec]:
    return [("p0", "prefill", ["--fake-kv-port", "7001"]), ("d0", "decode", ["--fake-kv-port", "7002"])]


@pytest.fixture(scope="module")
def push_pair() -> Iterator[MockCluster]:
    c = MockCluster(_pd_specs(), mode=TransferMode.PUSH)
    yield c
    c.close()


@pytest.fixture(scope="module")
def pull_pair() -> Iterator[MockCluster]:
    c = MockCluster(_pd_specs(), mode=TransferMode.PULL)
    yield c
    c.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_and_full_pass_through_byte_for_byte(single: MockCluster, path: str) -> None:
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"model": "mock", "max_tokens": 7, "stream": True,
                            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    ttft = 'kvwire_router_ttft_seconds_count{mode="colocated"}'
    itl = 'kvwire_router_itl_seconds_count{mode="colocated"}'
    ttft0, itl0 = single.metric(ttft), single.metric(itl)
    direct = post(single.mocks["m0"].url, path, body)
    routed = post(single.url, path, body)
    assert direct[0] == routed[0] == 200
    assert routed[1] == direct[1]
    assert routed[1].endswith(b"data: [DONE]\n\n") and b" t6" in routed[1]
    assert single.metric(ttft) == ttft0 + 1
    assert single.metric(itl) == itl0 + 6  # 7 tokens -> 6 gaps (role and usage events do not count)
    body["stream"] = False
    body.pop("stream_options")
    direct, routed = post(single.mocks["m0"].url, path, body), post(single.url, path, body)
    assert routed == direct and json.loads(routed[1])["usage"]["completion_tokens"] == 7


@pytest.mark.parametrize("status", [400, 404, 422, 500, 503])
def test_upstream_errors_keep_status_and_message(single: MockCluster, status: int) -> None:
    for stream in (False, True):
        code, data = post(single.url, "/v1/completions", {"prompt": f"status={status}", "stream": stream})
        assert code == status
        assert json.loads(data)["error"]["message"] == f"mock m0 says {status}"
    assert "m0" in live_ids(single.router)  # an error answer is not a dead instance


def test_bad_input_and_no_instance(cluster: Any) -> None:
    c = cluster([])
    code, data = post(c.url, "/v1/completions", {"prompt": "x"})
    assert code == 503 and "no live instance" in json.loads(data)["error"]["message"]
    assert post(c.url, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert post(c.url, "/v1/completions", None, raw=b"[1, 2]")[0] == 400
    assert post(c.url, "/v1/completions", {"prompt": "x", "stream": "yes"})[0] == 400
    assert post(c.url, "/v1/chat/completions", {"messages": "hi"})[0] == 400
    code, data = post(c.url, "/v1/completions", {"prompt": "x" * 100_000})
    assert code == 413 and "limit" in json.loads(data)["error"]["message"]
    assert c.metric('kvwire_router_requests_total{endpoint="/v1/completions",outcome="no_instance"}') == 1


def test_models_union_and_unknown_model(cluster: Any) -> None:
    c = cluster([("a", "both", ["--model", "alpha"]), ("b", "both", ["--model", "beta"])])
    assert [m["id"] for m in get(c.url, "/v1/models")["data"]] == ["alpha", "beta"]
    code, data = post(c.url, "/v1/completions", {"model": "beta", "prompt": "x"})
    assert code == 200 and json.loads(data)["served_by"] == "b"
    assert post(c.url, "/v1/completions", {"model": "gamma", "prompt": "x"})[0] == 404
    rows = {r["id"]: r for r in get(c.url, "/instances")}
    assert rows["a"]["alive"] and rows["a"]["role"] == "both" and rows["a"]["model"] == "alpha"
    assert rows["a"]["load"]["total_kv_blocks"] == 100 and rows["a"]["last_seen_s"] < 5


def _send_raw(url: str, body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _abandon(c: MockCluster, body: dict[str, Any], arrives_at: str) -> None:
    """Send a request, wait until ``arrives_at`` has it, then vanish (client disconnect)."""
    before = c.count(arrives_at, "requests")
    sock = _send_raw(c.url, body)
    wait_for(lambda: c.count(arrives_at, "requests") > before, 10, "upstream got the request")
    sock.close()


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_upstream(single: MockCluster, stream: bool) -> None:
    before = single.count("m0", "disconnects")
    _abandon(single, {"prompt": "hang", "stream": stream}, "m0")
    wait_for(lambda: single.count("m0", "disconnects") == before + 1, 10, "upstream saw the disconnect")


def test_upstream_dying_mid_stream_is_reported_in_band(single: MockCluster) -> None:
    errors = 'kvwire_router_requests_total{endpoint="/v1/completions",outcome="upstream_error"}'
    before = single.metric(errors)
    code, data = post(single.url, "/v1/completions", {"prompt": "drop", "max_tokens": 5, "stream": True})
    assert code == 200  # headers were already sent
    assert b" t1" in data and b" t2" not in data
    # the error event, then the end of the stream (the mock gives no token ids: nothing to migrate)
    assert data.endswith(b"data: [DONE]\n\n") and b'"upstream_error"' in data
    last = data.strip().split(b"\n\n")[-2]
    assert last.startswith(b"data: ") and "failed mid-stream" in json.loads(last[6:])["error"]["message"]
    assert single.metric(errors) == before + 1
    single.wait_all_live()  # the broken connection took m0 out until its next heartbeat


def test_least_loaded_avoids_the_busy_instance(cluster: Any) -> None:
    c = cluster([("m0", "both", []), ("m1", "both", [])], policy=Policy.LEAST_LOADED)
    with _send_raw(c.url, {"prompt": "hang", "stream": True}):
        wait_for(lambda: c.count("m0", "requests") + c.count("m1", "requests") == 1, 10, "hang arrived")
        busy = "m0" if c.count("m0", "requests") else "m1"
        rows = {r["id"]: r for r in get(c.url, "/instances")}
        assert rows[busy]["router_inflight"]["requests"] == 1
        answers = [post(c.url, "/v1/completions", {"prompt": "x"})[1] for _ in range(4)]
        served = {json.loads(a)["served_by"] for a in answers}
        assert served == {"m1" if busy == "m0" else "m0"}


def test_push_sends_p_and_d_concurrently(push_pair: MockCluster) -> None:
    c = push_pair
    n_p, n_d = c.count("p0", "requests"), c.count("d0", "requests")
    done_p = c.count("p0", "completed")
    ttft = 'kvwire_router_ttft_seconds_count{mode="pd"}'
    ttft0 = c.metric(ttft)
    body = {"prompt": "hello prefill.delay", "max_tokens": 5, "min_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    code, data = post(c.url, "/v1/completions", body)
    assert code == 200 and data.endswith(b"data: [DONE]\n\n") and b" t4" in data
    # The mock D does not wait for KV, so P may still be busy: the router lets it finish.
    wait_for(lambda: c.count("p0", "completed") == done_p + 1, 10, "prefill answered")
    p_req = c.mocks["p0"].stats()["requests"][n_p]
    d_req = c.mocks["d0"].stats()["requests"][n_d]
    pb, db = p_req["body"], d_req["body"]
    assert pb["max_tokens"] == 1 and pb["max_completion_tokens"] == 1 and pb["stream"] is False
    assert "stream_options" not in pb and "min_tokens" not in pb
    assert db["max_tokens"] == 5 and db["stream"] is True and db["min_tokens"] == 2
    pk, dk = pb["kv_transfer_params"], db["kv_transfer_params"]
    assert pk["transfer_id"] == dk["transfer_id"] and len(pk["transfer_id"]) == 32
    assert (pk["role"], pk["mode"], pk["peer_endpoints"]) == ("prefill", "push", ["tcp://127.0.0.1:7002"])
    assert (dk["role"], dk["mode"], dk["peer_endpoints"]) == ("decode", "push", ["tcp://127.0.0.1:7001"])
    assert pk["peer_instance_id"] == "d0" and dk["peer_instance_id"] == "p0"
    # Concurrent: D had its request while P was still working on its (delayed) answer.
    assert d_req["received_at"] < p_req["answered_at"]
    assert c.metric(ttft) == ttft0 + 1


def test_push_prefill_rejection_cancels_decode(push_pair: MockCluster) -> None:
    before = push_pair.count("d0", "disconnects")
    body = {"prompt": "prefill.status=400 decode.hang", "stream": True}
    code, data = post(push_pair.url, "/v1/completions", body)
    assert code == 400 and json.loads(data)["error"]["message"] == "mock p0 says 400"
    wait_for(lambda: push_pair.count("d0", "disconnects") == before + 1, 10, "decode request cancelled")


@pytest.mark.parametrize("stream", [False, True])
def test_push_prefill_failure_leaves_decode_to_recover(push_pair: MockCluster, stream: bool) -> None:
    # D answers 0.3 s after P failed with a 500: D (which would recompute) decides the outcome.
    body = {"prompt": "prefill.status=500 decode.delay", "stream": stream}
    code, data = post(push_pair.url, "/v1/completions", body)
    assert code == 200 and b" t15" in data


def test_push_decode_error_cancels_prefill(push_pair: MockCluster) -> None:
    before = push_pair.count("p0", "disconnects")
    code, data = post(push_pair.url, "/v1/completions", {"prompt": "decode.status=422 prefill.hang"})
    assert code == 422 and json.loads(data)["error"]["message"] == "mock d0 says 422"
    wait_for(lambda: push_pair.count("p0", "disconnects") == before + 1, 10, "prefill request cancelled")


@pytest.mark.parametrize("stream", [False, True])
def test_push_client_disconnect_aborts_p_and_d(push_pair: MockCluster, stream: bool) -> None:
    c = push_pair
    p_before, d_before = c.count("p0", "disconnects"), c.count("d0", "disconnects")
    _abandon(c, {"prompt": "hang", "stream": stream}, "d0")
    wait_for(lambda: c.count("p0", "disconnects") == p_before + 1, 10, "prefill aborted")
    wait_for(lambda: c.count("d0", "disconnects") == d_before + 1, 10, "decode aborted")


def test_pull_forwards_prefill_params_to_decode(pull_pair: MockCluster) -> None:
    c = pull_pair
    n_p, n_d = c.count("p0", "requests"), c.count("d0", "requests")
    code, data = post(c.url, "/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert code == 200 and json.loads(data)["served_by"] == "d0"
    p_req = c.mocks["p0"].stats()["requests"][n_p]
    d_req = c.mocks["d0"].stats()["requests"][n_d]
    pk, dk = p_req["body"]["kv_transfer_params"], d_req["body"]["kv_transfer_params"]
    # D is picked first and named in P's params: only it may pull P's leased KV (decision 044).
    assert (pk["mode"], pk["role"], pk["peer_endpoints"]) == ("pull", "prefill", ["tcp://127.0.0.1:7002"])
    assert (dk["mode"], dk["role"], dk["transfer_id"]) == ("pull", "decode", pk["transfer_id"])
    assert dk["peer_endpoints"] == ["tcp://127.0.0.1:7001"] and dk["first_token_id"] == 42
    assert d_req["received_at"] >= p_req["answered_at"]


def test_pull_without_params_from_prefill_is_a_clear_502(pull_pair: MockCluster) -> None:
    n_d = pull_pair.count("d0", "requests")
    code, data = post(pull_pair.url, "/v1/completions", {"prompt": "noparams"})
    assert code == 502 and "kv_transfer_params" in json.loads(data)["error"]["message"]
    assert pull_pair.count("d0", "requests") == n_d


def test_refused_connection_is_retried_and_marked_out(cluster: Any) -> None:
    c = cluster([("good", "both", [])])
    # Register a "zombie" at a port nobody listens on.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    info = InstanceInfo(instance_id="aaa-zombie", role=Role.BOTH, url=f"http://127.0.0.1:{dead_port}",
                        model="mock")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(c.router.discovery)
        push.send_multipart(encode_frames(Heartbeat(info=info, seq=1)))
        wait_for(lambda: "aaa-zombie" in live_ids(c.router), 10, "zombie registered")
        for _ in range(4):
            code, data = post(c.url, "/v1/completions", {"prompt": "x"})
            assert code == 200 and json.loads(data)["served_by"] == "good"
        rows = {r["id"]: r for r in get(c.url, "/instances")}
        assert rows["aaa-zombie"]["state"] == "unreachable" and "connect" in rows["aaa-zombie"]["reason"]
        assert c.metric("kvwire_router_retries_total") == 1
        assert c.metric('kvwire_router_upstream_errors_total{kind="connect",role="both"}') == 1
    finally:
        push.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_first_token_from_prefill_streamed_at_once(cluster: Any, path: str) -> None:
    c = cluster(_pd_specs(), mode=TransferMode.PUSH, stream_first_token_from_prefill=True)
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"max_tokens": 4, "stream": True}
    prompt = "decode.delay"  # D answers 0.3 s late: P's token must reach the client before
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    host, port = c.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events: list[tuple[float, bytes]] = []
        for line in resp:
            if line.startswith(b"data: "):
                events.append((time.monotonic(), line[6:].strip()))
    finally:
        conn.close()
    assert events[-1][1] == b"[DONE]"
    chunks = [json.loads(data)["choices"][0] for _, data in events[:-1]]
    pieces = [ch["delta"].get("content", "") if chat else ch["text"] for ch in chunks]
    assert "".join(pieces) == " t0 t1 t2 t3"
    first_token = next(i for i, p in enumerate(pieces) if p)
    assert pieces[first_token] == " t0" and chunks[-1]["finish_reason"] == "length"
    # P's token went out well before D's first event (D was 0.3 s late).
    assert events[first_token + 1][0] - events[first_token][0] > 0.15
