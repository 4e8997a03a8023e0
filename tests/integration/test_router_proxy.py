"""Router request path against mock upstream processes: pass-through, errors, disconnects, P/D dispatch."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from mock_instance import MockProcess, RouterThread, get, get_raw, live_ids, post, router_config, wait_for

from kvwire.discovery import Heartbeat, InstanceInfo, InstanceRole, encode_frames
from kvwire.kv_params import TransferMode
from kvwire.router.config import Policy

INTERVAL = ["--interval-s", "0.2"]


@pytest.fixture
def cluster() -> Iterator[Any]:
    """Factory: cluster(router_kwargs, [(id, role, extra args)...]) -> (router, {id: mock})."""
    routers: list[RouterThread] = []
    mocks: list[MockProcess] = []

    def make(specs: list[tuple[str, str, list[str]]], **router_kw: Any) -> tuple[RouterThread, Any]:
        router = RouterThread(router_config(**router_kw))
        routers.append(router)
        out = {}
        for ident, role, extra in specs:
            mock = MockProcess(router.discovery, ident, "--role", role, *INTERVAL, *extra)
            mocks.append(mock)
            out[ident] = mock
        wait_for(lambda: live_ids(router) >= set(out), 10, "mocks registered")
        return router, out

    yield make
    for mock in mocks:
        mock.kill()
    for router in routers:
        router.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_and_full_pass_through_byte_for_byte(cluster: Any, path: str) -> None:
    router, mocks = cluster([("m0", "both", [])])
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"model": "mock", "max_tokens": 7, "stream": True,
                            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    direct = post(mocks["m0"].url, path, body)
    routed = post(router.url, path, body)
    assert direct[0] == routed[0] == 200
    assert routed[1] == direct[1]
    assert routed[1].endswith(b"data: [DONE]\n\n") and b" t6" in routed[1]
    body["stream"] = False
    body.pop("stream_options")
    direct, routed = post(mocks["m0"].url, path, body), post(router.url, path, body)
    assert routed == direct and json.loads(routed[1])["usage"]["completion_tokens"] == 7
    metrics = get_raw(router.url, "/metrics")[1].decode()
    assert 'kvwire_router_ttft_seconds_count{mode="colocated"} 1.0' in metrics
    assert 'kvwire_router_itl_seconds_count{mode="colocated"} 6.0' in metrics  # 7 tokens -> 6 gaps


@pytest.mark.parametrize("status", [400, 404, 422, 500, 503])
def test_upstream_errors_keep_status_and_message(cluster: Any, status: int) -> None:
    router, _ = cluster([("m0", "both", [])])
    for stream in (False, True):
        code, data = post(router.url, "/v1/completions", {"prompt": f"status={status}", "stream": stream})
        assert code == status
        assert json.loads(data)["error"]["message"] == f"mock m0 says {status}"
    assert "m0" in live_ids(router)  # an error answer is not a dead instance


def test_bad_input_and_no_instance(cluster: Any) -> None:
    router, _ = cluster([])
    code, data = post(router.url, "/v1/completions", {"prompt": "x"})
    assert code == 503 and "no live instance" in json.loads(data)["error"]["message"]
    assert post(router.url, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert post(router.url, "/v1/completions", None, raw=b"[1, 2]")[0] == 400
    assert post(router.url, "/v1/completions", {"prompt": "x", "stream": "yes"})[0] == 400
    assert post(router.url, "/v1/chat/completions", {"messages": "hi"})[0] == 400
    code, data = post(router.url, "/v1/completions", {"prompt": "x" * 100_000})
    assert code == 413 and "limit" in json.loads(data)["error"]["message"]
    metrics = get_raw(router.url, "/metrics")[1].decode()
    assert 'kvwire_router_requests_total{endpoint="/v1/completions",outcome="no_instance"} 1.0' in metrics


def test_models_union_and_unknown_model(cluster: Any) -> None:
    router, _ = cluster([("a", "both", ["--model", "alpha"]), ("b", "both", ["--model", "beta"])])
    assert [m["id"] for m in get(router.url, "/v1/models")["data"]] == ["alpha", "beta"]
    code, data = post(router.url, "/v1/completions", {"model": "beta", "prompt": "x"})
    assert code == 200 and json.loads(data)["served_by"] == "b"
    assert post(router.url, "/v1/completions", {"model": "gamma", "prompt": "x"})[0] == 404
    rows = {r["id"]: r for r in get(router.url, "/instances")}
    assert rows["a"]["alive"] and rows["a"]["role"] == "both" and rows["a"]["model"] == "alpha"
    assert rows["a"]["load"]["total_kv_blocks"] == 100 and rows["a"]["last_seen_s"] < 5


def _open_and_abandon(url: str, body: dict[str, Any], mock: MockProcess) -> None:
    """Send a request on a raw socket, wait until the mock has it, then vanish."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    wait_for(lambda: len(mock.stats()["requests"]) >= 1, 10, "upstream got the request")
    sock.close()


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_upstream(cluster: Any, stream: bool) -> None:
    router, mocks = cluster([("m0", "both", [])])
    _open_and_abandon(router.url, {"prompt": "hang", "stream": stream}, mocks["m0"])
    wait_for(lambda: len(mocks["m0"].stats()["disconnects"]) == 1, 10, "upstream saw the disconnect")


def _pd(cluster: Any, mode: TransferMode, p_extra: list[str] | None = None) -> tuple[RouterThread, Any]:
    return cluster(
        [("p0", "prefill", ["--fake-kv-port", "7001", *(p_extra or [])]),
         ("d0", "decode", ["--fake-kv-port", "7002"])],
        mode=mode,
    )


def test_push_sends_p_and_d_concurrently(cluster: Any) -> None:
    router, mocks = _pd(cluster, TransferMode.PUSH, ["--delay-s", "0.3"])
    body = {"prompt": "hello", "max_tokens": 5, "min_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    code, data = post(router.url, "/v1/completions", body)
    assert code == 200 and data.endswith(b"data: [DONE]\n\n") and b" t4" in data
    # The mock D does not wait for KV, so P may still be busy: the router lets it finish.
    wait_for(lambda: mocks["p0"].stats()["completed"] == 1, 10, "prefill answered")
    p_req = mocks["p0"].stats()["requests"][0]
    d_req = mocks["d0"].stats()["requests"][0]
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
    metrics = get_raw(router.url, "/metrics")[1].decode()
    assert 'kvwire_router_ttft_seconds_count{mode="pd"} 1.0' in metrics


def test_pull_forwards_prefill_params_to_decode(cluster: Any) -> None:
    router, mocks = _pd(cluster, TransferMode.PULL)
    code, data = post(router.url, "/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert code == 200 and json.loads(data)["served_by"] == "d0"
    p_req = mocks["p0"].stats()["requests"][0]
    d_req = mocks["d0"].stats()["requests"][0]
    pk, dk = p_req["body"]["kv_transfer_params"], d_req["body"]["kv_transfer_params"]
    assert (pk["mode"], pk["role"], pk["peer_endpoints"]) == ("pull", "prefill", [])
    assert (dk["mode"], dk["role"], dk["transfer_id"]) == ("pull", "decode", pk["transfer_id"])
    assert dk["peer_endpoints"] == ["tcp://127.0.0.1:7001"] and dk["first_token_id"] == 42
    assert d_req["received_at"] >= p_req["answered_at"]


def test_push_prefill_rejection_cancels_decode(cluster: Any) -> None:
    router, mocks = _pd(cluster, TransferMode.PUSH)
    body = {"prompt": "prefill.status=400 decode.hang", "stream": True}
    code, data = post(router.url, "/v1/completions", body)
    assert code == 400 and json.loads(data)["error"]["message"] == "mock p0 says 400"
    wait_for(lambda: len(mocks["d0"].stats()["disconnects"]) == 1, 10, "decode request cancelled")


@pytest.mark.parametrize("stream", [False, True])
def test_push_prefill_failure_leaves_decode_to_recover(cluster: Any, stream: bool) -> None:
    # D answers 0.3 s after P failed with a 500: D (which would recompute) decides the outcome.
    router, _ = cluster(
        [("p0", "prefill", []), ("d0", "decode", ["--delay-s", "0.3"])], mode=TransferMode.PUSH
    )
    code, data = post(router.url, "/v1/completions", {"prompt": "prefill.status=500", "stream": stream})
    assert code == 200 and b" t15" in data


@pytest.mark.parametrize("stream", [False, True])
def test_push_client_disconnect_aborts_p_and_d(cluster: Any, stream: bool) -> None:
    router, mocks = _pd(cluster, TransferMode.PUSH)
    _open_and_abandon(router.url, {"prompt": "hang", "stream": stream}, mocks["d0"])
    wait_for(lambda: len(mocks["p0"].stats()["requests"]) == 1, 10, "prefill got its request")
    wait_for(lambda: len(mocks["p0"].stats()["disconnects"]) == 1, 10, "prefill aborted")
    wait_for(lambda: len(mocks["d0"].stats()["disconnects"]) == 1, 10, "decode aborted")


def test_refused_connection_is_retried_and_marked_out(cluster: Any) -> None:
    router, _ = cluster([("good", "both", [])])
    # Register a "zombie" at a port nobody listens on.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    info = InstanceInfo(instance_id="aaa-zombie", role=InstanceRole.BOTH, url=f"http://127.0.0.1:{dead_port}",
                        model="mock")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(router.discovery)
        push.send_multipart(encode_frames(Heartbeat(info=info, seq=1)))
        wait_for(lambda: "aaa-zombie" in live_ids(router), 10, "zombie registered")
        for _ in range(4):
            code, data = post(router.url, "/v1/completions", {"prompt": "x"})
            assert code == 200 and json.loads(data)["served_by"] == "good"
        rows = {r["id"]: r for r in get(router.url, "/instances")}
        assert rows["aaa-zombie"]["state"] == "unreachable" and "connect" in rows["aaa-zombie"]["reason"]
        metrics = get_raw(router.url, "/metrics")[1].decode()
        assert "kvwire_router_retries_total 1.0" in metrics
        assert 'kvwire_router_upstream_errors_total{kind="connect",role="both"} 1.0' in metrics
    finally:
        push.close(linger=0)
        ctx.term()


def test_upstream_dying_mid_stream_is_reported_in_band(cluster: Any) -> None:
    router, _ = cluster([("m0", "both", [])])
    code, data = post(router.url, "/v1/completions", {"prompt": "drop", "max_tokens": 5, "stream": True})
    assert code == 200  # headers were already sent
    assert b" t1" in data and b" t2" not in data and b"[DONE]" not in data
    last = data.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ") and "failed mid-stream" in json.loads(last[6:])["error"]["message"]
    metrics = get_raw(router.url, "/metrics")[1].decode()
    assert 'outcome="upstream_error"} 1.0' in metrics


def test_least_loaded_avoids_the_busy_instance(cluster: Any) -> None:
    router, mocks = cluster([("m0", "both", []), ("m1", "both", [])], policy=Policy.LEAST_LOADED)
    host, port = router.url.removeprefix("http://").split(":")
    data = json.dumps({"prompt": "hang", "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_for(lambda: sum(len(m.stats()["requests"]) for m in mocks.values()) == 1, 10, "hang arrived")
        busy = next(i for i, m in mocks.items() if m.stats()["requests"])
        rows = {r["id"]: r for r in get(router.url, "/instances")}
        assert rows[busy]["router_inflight"]["requests"] == 1
        served = {json.loads(post(router.url, "/v1/completions", {"prompt": "x"})[1])["served_by"]
                  for _ in range(4)}
        assert served == {"m1" if busy == "m0" else "m0"}


def test_push_decode_error_cancels_prefill(cluster: Any) -> None:
    router, mocks = _pd(cluster, TransferMode.PUSH)
    code, data = post(router.url, "/v1/completions", {"prompt": "decode.status=422 prefill.hang"})
    assert code == 422 and json.loads(data)["error"]["message"] == "mock d0 says 422"
    wait_for(lambda: len(mocks["p0"].stats()["disconnects"]) == 1, 10, "prefill request cancelled")


def test_pull_without_params_from_prefill_is_a_clear_502(cluster: Any) -> None:
    router, mocks = _pd(cluster, TransferMode.PULL)
    code, data = post(router.url, "/v1/completions", {"prompt": "noparams"})
    assert code == 502 and "kv_transfer_params" in json.loads(data)["error"]["message"]
    assert mocks["d0"].stats()["requests"] == []
