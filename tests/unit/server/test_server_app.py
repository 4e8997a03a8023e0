"""The HTTP layer and engine thread against a deterministic fake engine (fault injection lives here;
the real engine is exercised in tests/integration/test_server.py)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

from aiohttp import ClientSession

from support.fake_engine_server import sse_payloads, wait_until

KV = {"transfer_id": "t-1", "role": "prefill", "mode": "pull"}


def test_completion_json_and_stream_agree(run_with_fake_server: Any, fake_engine: Any) -> None:
    async def body(server: Any) -> None:
        req = {"model": "fake", "prompt": "hi", "max_tokens": 5, "kv_transfer_params": KV,
               "return_token_ids": True}
        resp = await server.client.post("/v1/completions", json=req)
        assert resp.status == 200, await resp.text()
        full = await resp.json()
        assert full["object"] == "text_completion"
        choice = full["choices"][0]
        assert choice["text"] == "bcdef"  # ord("i") = 105 = 1 mod 26 -> "b", "c", ...
        assert choice["finish_reason"] == "length"
        assert choice["token_ids"] == list(b"bcdef")
        assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        assert full["kv_transfer_params"] == {"echo": KV}

        resp = await server.client.post("/v1/completions", json={
            **req, "stream": True, "stream_options": {"include_usage": True}})
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_payloads(await resp.read())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage = chunks.pop()
        assert usage["choices"] == [] and usage["usage"] == full["usage"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
        assert chunks[-1]["kv_transfer_params"] == {"echo": KV}
        assert all("kv_transfer_params" not in c for c in chunks[:-1])
        assert len({c["id"] for c in chunks}) == 1
        assert threading.get_ident() not in fake_engine.thread_ids and len(fake_engine.thread_ids) == 1

    run_with_fake_server(body, fake_engine)


def test_chat_stream_opens_with_role(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        resp = await server.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True})
        events = sse_payloads(await resp.read())
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        resp = await server.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
        full = await resp.json()
        assert full["choices"][0]["message"] == {"role": "assistant", "content": text}
        assert len(text) == 3

    run_with_fake_server(body)


def test_step_failure_is_500_and_server_keeps_serving(run_with_fake_server: Any, fake_engine: Any) -> None:
    async def body(server: Any) -> None:
        fake_engine.fail_next_step = True
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert resp.status == 500
        err = (await resp.json())["error"]
        assert "injected step failure" in err["message"] and err["type"] == "server_error"
        fake_engine.fail_next_step = True
        req = {"prompt": "a", "max_tokens": 3, "stream": True}
        resp = await server.client.post("/v1/completions", json=req)
        events = sse_payloads(await resp.read())
        assert "injected step failure" in json.loads(events[0])["error"]["message"]
        assert events[-1] == "[DONE]"
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert resp.status == 200
        assert (await server.client.get("/health")).status == 200

    run_with_fake_server(body, fake_engine)


def test_error_output_is_500(run_with_fake_server: Any, fake_engine: Any) -> None:
    real_add = fake_engine.add_request

    def add_failing(request_id: str, *args: Any) -> None:
        fake_engine.error_output_for.add(request_id)
        real_add(request_id, *args)

    fake_engine.add_request = add_failing

    async def body(server: Any) -> None:
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert resp.status == 500
        assert "injected" in (await resp.json())["error"]["message"]

    run_with_fake_server(body, fake_engine)


def test_disconnect_aborts_and_frees_blocks(run_with_fake_server: Any, fake_engine: Any) -> None:
    fake_engine.step_delay_s = 0.01

    async def body(server: Any) -> None:
        url = str(server.client.make_url("/v1/completions"))
        async with ClientSession() as session:
            resp = await session.post(url, json={"prompt": "abc", "max_tokens": 50, "stream": True})
            await resp.content.readline()  # first event arrived: the request is running
            assert fake_engine.blocks_in_use() > 0
            resp.close()  # drop the connection mid-stream
        await wait_until(lambda: fake_engine.aborted != [] and server.engine_loop.stats.kv_blocks_in_use == 0)
        assert not fake_engine.reqs and server.engine_loop.num_streams == 0

    run_with_fake_server(body, fake_engine)


def test_shutdown_aborts_in_flight_with_503(run_with_fake_server: Any, fake_engine: Any) -> None:
    fake_engine.step_delay_s = 0.01

    async def body(server: Any) -> None:
        req = {"prompt": "a", "max_tokens": 50}
        task = asyncio.create_task(server.client.post("/v1/completions", json=req))
        await wait_until(lambda: bool(fake_engine.reqs))
        server.generation.draining = True
        server.engine_loop.abort_all("stopping")
        resp = await task
        assert resp.status == 503
        assert (await server.client.get("/health")).status == 503
        resp = await server.client.post("/v1/completions", json={"prompt": "a"})
        assert resp.status == 503
        assert not fake_engine.reqs

    run_with_fake_server(body, fake_engine)


def test_errors_are_openai_shaped(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        resp = await server.client.post("/v1/completions", json={"model": "gpt-9", "prompt": "a"})
        assert resp.status == 404
        assert (await resp.json())["error"]["reason"] == "model_not_found"
        resp = await server.client.post("/v1/nothing", json={})
        assert resp.status == 404 and "error" in await resp.json()
        resp = await server.client.get("/v1/completions")
        assert resp.status == 405 and "error" in await resp.json()
        resp = await server.client.post("/v1/completions", data=b"x" * (2 << 20))
        assert resp.status == 413 and "error" in await resp.json()
        resp = await server.client.post("/v1/completions", json={"prompt": "a" * 200})
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["reason"] == "context_length_exceeded" and err["code"] == 400
        assert err["param"] == "prompt"
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 63})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "max_tokens"
        resp = await server.client.post("/v1/completions", json={"prompt": [1, 999]})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
        req = {"prompt": "a", "kv_transfer_params": {"x": 1}}
        resp = await server.client.post("/v1/completions", json=req)
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "kv_transfer_params"
        assert (await server.client.get("/health")).status == 200

    run_with_fake_server(body)


def test_kv_params_refused_without_connector(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "kv_transfer_params": KV})
        assert resp.status == 400
        assert "no KV connector" in (await resp.json())["error"]["message"]

    run_with_fake_server(body, accepts_kv=False)


def test_models_and_metrics(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        models = await (await server.client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["fake"]
        assert models["data"][0]["max_model_len"] == 64
        req = {"prompt": "ab", "max_tokens": 4, "stream": True}
        resp = await server.client.post("/v1/completions", json=req)
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")  # the handler has finished
        resp = await server.client.post("/v1/completions", json={"prompt": "", "max_tokens": 4})
        assert resp.status == 400
        text = await (await server.client.get("/metrics")).text()
        assert 'kvwire_requests_total{endpoint="completion",outcome="length"} 1.0' in text
        assert 'kvwire_requests_total{endpoint="completion",outcome="invalid"} 1.0' in text
        assert "kvwire_prompt_tokens_total 3.0" in text
        assert "kvwire_generation_tokens_total 4.0" in text
        assert "kvwire_time_to_first_token_seconds_count 1.0" in text
        assert "kvwire_inter_token_latency_seconds_count 3.0" in text
        assert "kvwire_kv_blocks_in_use 0.0" in text
        assert "kvwire_kv_blocks_total 256.0" in text
        sample = re.search(r"^kvwire_engine_stats_age_seconds (\S+)$", text, re.MULTILINE)
        assert sample is not None
        age = float(sample.group(1))
        assert 0.0 <= age < 30.0  # seconds since a copy, not a raw clock value
        assert "kvwire_num_requests_running 0.0" in text
        assert "kvwire_num_requests_waiting 0.0" in text

    run_with_fake_server(body)


def test_broken_engine_stops_thread_and_is_unhealthy(run_with_fake_server: Any, fake_engine: Any) -> None:
    real_step = fake_engine.step

    def always_failing_step() -> Any:
        fake_engine.fail_next_step = True
        return real_step()

    fake_engine.step = always_failing_step
    fake_engine.has_unfinished_requests = lambda: True  # like the real engine: it keeps asking to step

    async def body(server: Any) -> None:
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert resp.status == 500
        await wait_until(lambda: not server.engine_loop.alive)
        assert server.engine_loop.num_step_errors == 5  # MAX_CONSECUTIVE_STEP_ERRORS
        assert (await server.client.get("/health")).status == 503
        resp = await server.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert resp.status == 500 and "not running" in (await resp.json())["error"]["message"]

    run_with_fake_server(body, fake_engine)


def test_non_streaming_disconnect_aborts(run_with_fake_server: Any, fake_engine: Any) -> None:
    fake_engine.step_delay_s = 0.01

    async def body(server: Any) -> None:
        url = str(server.client.make_url("/v1/completions"))
        async with ClientSession() as session:
            task = asyncio.create_task(session.post(url, json={"prompt": "abc", "max_tokens": 50}))
            await wait_until(lambda: bool(fake_engine.reqs))
            task.cancel()  # the client gives up: its connection closes
        await wait_until(lambda: fake_engine.aborted != [] and server.engine_loop.stats.kv_blocks_in_use == 0)
        assert server.engine_loop.num_streams == 0

    run_with_fake_server(body, fake_engine)


def test_stats_snapshot_records_when_it_was_copied() -> None:
    from types import SimpleNamespace

    from kvwire.server.engine_loop import StatsSnapshot

    stats = SimpleNamespace(num_running=2, kv_blocks_in_use=7, kv_blocks_total=64, taken_at=-1.0)
    before = time.monotonic()
    snap = StatsSnapshot.of(stats)
    assert (snap.num_running, snap.kv_blocks_in_use, snap.num_waiting) == (2, 7, 0)
    assert snap.taken_at >= before  # the copy time, never a field of the engine's stats
    assert snap.age_s(snap.taken_at + 2.5) == 2.5 and snap.age_s(snap.taken_at - 1.0) == 0.0
