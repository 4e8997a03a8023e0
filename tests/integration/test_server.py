"""``kvwire serve`` as a real subprocess on the ``tiny`` model (CPU): the OpenAI API end to end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq

from kvwire.cluster.local import free_port
from kvwire.discovery import Deregister, Heartbeat, decode_frames
from kvwire.discovery.heartbeats import KvEvents
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from kvwire.protocol.kv_signing import ParamsSigner

SECRET = "s3cret-0123456789abcdef0123456789ab"  # kvwire serve needs 32+ bytes (decision 124)
START_DEADLINE_S = 90.0
BASE_ARGS = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
             "--num-kv-blocks", "512", "--block-size", "16"]


class ServerProcess:
    def __init__(self, log_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "kvwire.cli", "serve", *BASE_ARGS, "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                status, _ = run(get(self.url + "/health"))
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not healthy within {START_DEADLINE_S}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return resp.status, raw
        return resp.status, json.loads(raw)


def sse_events(raw: bytes) -> list[Any]:
    """Strict SSE parse: `data: <payload>\\n\\n` events, the last one `[DONE]`; returns JSON payloads."""
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text[: -len("\n\n")].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events.count("data: [DONE]") == 1
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


async def metric(url: str, name: str) -> float:
    _, text = await get(url + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def until_metric(url: str, name: str, expected: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (value := await metric(url, name)) != expected:
        assert time.monotonic() < deadline, f"{name} is {value}, expected {expected}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def greedy(prompt: Any, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def test_completion_text_and_token_ids_agree(server: ServerProcess) -> None:
    async def body() -> None:
        async with aiohttp.ClientSession() as session:
            status, by_text = await post(session, server.url + "/v1/completions", greedy("hello world"))
            assert status == 200, by_text
            ids = by_text["prompt_token_ids"]
            assert len(ids) == by_text["usage"]["prompt_tokens"] > 0
            status, by_ids = await post(session, server.url + "/v1/completions", greedy(ids))
        assert status == 200, by_ids
        for out in (by_text, by_ids):
            choice = out["choices"][0]
            assert out["object"] == "text_completion" and out["model"] == "tiny"
            assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
            assert isinstance(choice["text"], str)
            assert out["usage"]["completion_tokens"] == 8
            assert out["usage"]["total_tokens"] == len(ids) + 8
        assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
        assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]

    run(body())


def test_sampling_parameters_reach_the_engine(server: ServerProcess) -> None:
    async def body() -> None:
        url = server.url + "/v1/completions"
        async with aiohttp.ClientSession() as session:
            _, base = await post(session, url, greedy("sampling", 12))
            ids = base["choices"][0]["token_ids"]
            stop_at = ids[5]
            _, stopped = await post(session, url, greedy("sampling", 12, stop_token_ids=[stop_at]))
            seeded = {**greedy("sampling", 12), "temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 7}
            outs = [await post(session, url, seeded) for _ in range(2)]
        choice = stopped["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["token_ids"] == ids[: ids.index(stop_at) + 1]
        (s1, a), (s2, b) = outs
        assert s1 == s2 == 200
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]  # same seed, same sample
        assert len(a["choices"][0]["token_ids"]) == 12

    run(body())


def test_streams_equal_non_streamed_greedy_output(server: ServerProcess) -> None:
    async def body() -> None:
        url = server.url
        async with aiohttp.ClientSession() as session:
            _, full = await post(session, url + "/v1/completions", greedy("stream me", 12))
            _, raw = await post(session, url + "/v1/completions", greedy(
                "stream me", 12, stream=True, stream_options={"include_usage": True}))
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                    "temperature": 0, "ignore_eos": True}
            status, chat_full = await post(session, url + "/v1/chat/completions", chat)
            _, chat_raw = await post(session, url + "/v1/chat/completions", {**chat, "stream": True})
        chunks = sse_events(raw)
        usage = chunks.pop()
        assert usage["choices"] == [] and usage["usage"] == full["usage"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
        streamed_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert streamed_ids == full["choices"][0]["token_ids"]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert "kv_transfer_params" in chunks[-1] and len({c["id"] for c in chunks}) == 1
        assert status == 200 and chat_full["object"] == "chat.completion"
        chat_chunks = sse_events(chat_raw)
        assert chat_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chat_chunks)
        assert text == chat_full["choices"][0]["message"]["content"]
        assert chat_full["usage"]["completion_tokens"] == 6

    run(body())


def test_32_concurrent_streams(server: ServerProcess) -> None:
    prompts = [f"request number {i}: " + "x" * (i * 3) for i in range(32)]

    async def body() -> None:
        url = server.url + "/v1/completions"
        async with aiohttp.ClientSession() as session:
            streamed = await asyncio.gather(*(post(session, url, greedy(p, 6, stream=True)) for p in prompts))
            # The same prompts again, not streamed, also all at once (greedy fp32: batch-invariant).
            full = await asyncio.gather(*(post(session, url, greedy(p, 6)) for p in prompts))
        for (status, raw), (_, body), prompt in zip(streamed, full, prompts, strict=True):
            assert status == 200
            chunks = sse_events(raw)
            ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            assert ids == body["choices"][0]["token_ids"], prompt
            assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"], prompt
        assert await metric(server.url, "kvwire_kv_blocks_in_use") == 0

    run(body())


BAD_BODIES: list[tuple[str, Any, int]] = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"", 400),
    ("/v1/completions", [1, 2], 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "x" * 300}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400),
    ("/v1/completions", {"prompt": [10, 99999]}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": "warm"}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, 400),
    ("/v1/completions", {"prompt": "hi", "kv_transfer_params": "x"}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "not-this-one"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
]


def test_bad_inputs_get_openai_errors_and_server_stays_healthy(server: ServerProcess) -> None:
    async def body() -> None:
        async with aiohttp.ClientSession() as session:
            for path, bad, expected in BAD_BODIES:
                status, out = await post(session, server.url + path, bad)
                assert status == expected, (bad, out)
                error = out["error"]
                assert error["message"] and error["type"] == "invalid_request_error", out
                # vLLM's four keys, code the status; kvwire's cause in "reason" where it has one
                assert set(error) - {"reason"} == {"message", "type", "param", "code"}, error
                assert error["code"] == expected, error
            status, out = await post(session, server.url + "/v1/completions", greedy("still fine", 2))
            assert status == 200 and out["usage"]["completion_tokens"] == 2
        assert (await get(server.url + "/health"))[0] == 200

    run(body())


def test_disconnect_aborts_and_frees_blocks(server: ServerProcess) -> None:
    async def body() -> None:
        async with aiohttp.ClientSession() as session:
            req = greedy("long one", 200, stream=True)
            resp = await session.post(server.url + "/v1/completions", json=req)
            assert resp.status == 200
            await resp.content.readline()  # the first token arrived: the request holds KV blocks
            assert await metric(server.url, "kvwire_kv_blocks_in_use") > 0
            resp.close()  # drop the connection mid-stream
        await until_metric(server.url, "kvwire_kv_blocks_in_use", 0)
        _, text = await get(server.url + "/metrics")
        assert 'kvwire_requests_total{endpoint="completion",outcome="disconnect"}' in text

    run(body())


def test_models_health_and_metrics(server: ServerProcess) -> None:
    async def body() -> None:
        status, models = await get(server.url + "/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(models)["data"]] == ["tiny"]
        status, text = await get(server.url + "/metrics")
        assert status == 200
        for name in ("kvwire_requests_total", "kvwire_prompt_tokens_total",
                     "kvwire_generation_tokens_total", "kvwire_num_requests_running",
                     "kvwire_num_requests_waiting", "kvwire_kv_blocks_in_use",
                     "kvwire_time_to_first_token_seconds_bucket",
                     "kvwire_inter_token_latency_seconds_bucket"):
            assert f"\n{name}" in text, name
        assert await metric(server.url, "kvwire_time_to_first_token_seconds_count") > 0
        # The stall watchdog is on (default 120 s) and every test of this module ran under it.
        assert await metric(server.url, "kvwire_engine_stalled") == 0
        assert await metric(server.url, "kvwire_engine_stalls_total") == 0

    run(body())


def test_sigterm_stops_gracefully_mid_stream(tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path / "serve.log", "--shutdown-deadline-s", "5")
    try:
        proc.wait_healthy()

        async def body() -> bytes:
            async with aiohttp.ClientSession() as session:
                resp = await session.post(proc.url + "/v1/completions", json=greedy("abc", 240, stream=True))
                await resp.content.readline()
                os.kill(proc.proc.pid, signal.SIGTERM)
                return await resp.read()  # the stream must end (not hang) once the server stops

        rest = run(body())
        assert proc.proc.wait(timeout=15) == 0, proc.log()
        assert rest.endswith(b"data: [DONE]\n\n") and b"shutting down" in rest
        assert "kvwire serve stopped" in proc.log()
    finally:
        proc.stop()


class FakeRouter:
    """The router's discovery socket, reduced to a PULL socket that decodes what arrives."""

    def __init__(self, secret: bytes) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self.address = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._secret = secret

    def next_message(self, timeout_s: float = 10.0) -> Any:
        """The next heartbeat or deregistration (KV events, e.g. the cache snapshot an instance sends
        on a new router connection, are skipped: these tests are about liveness)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            assert self._sock.poll(left_ms), "no discovery message in time"
            message = decode_frames(self._sock.recv_multipart(), self._secret)
            if not isinstance(message, KvEvents):
                return message

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def test_prefill_role_registers_serves_pull_and_deregisters(tmp_path: Path) -> None:
    router = FakeRouter(SECRET.encode())
    proc = ServerProcess(
        tmp_path / "serve.log", "--role", "prefill", "--router", router.address, "--heartbeat-interval-s",
        "0.2", "--instance-id", "p-test", "--kv-deadline-s", "3", env={"KVWIRE_SECRET": SECRET})
    try:
        proc.wait_healthy()
        beat = router.next_message()
        assert isinstance(beat, Heartbeat)
        info = beat.info
        assert (info.instance_id, info.role, info.url, info.model) == ("p-test", Role.PREFILL,
                                                                        proc.url, "tiny")
        assert len(info.kv_endpoints) == 1 and info.kv_endpoints[0].startswith("tcp://127.0.0.1:")
        assert beat.load is not None and beat.load.total_kv_blocks == 512
        # the heartbeat thread runs supervised on the instance's one health board (decision 117)
        assert run(metric(proc.url, 'kvwire_component_up{component="kvwire-heartbeat"}')) == 1

        # Pull mode: P prefills, keeps the blocks under a lease and returns params for D. With the
        # secret set, P accepts only params the router signed (docs/security.md).
        kv = ParamsSigner(SECRET).sign(KVTransferParams(
            transfer_id="t-pull", role=Role.PREFILL, mode=TransferMode.PULL)).to_dict()
        async def body() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session:
                status, out = await post(session, proc.url + "/v1/completions",
                                         greedy("hello there", 1, kv_transfer_params=kv))
            assert status == 200, out
            return dict(out)

        async def wrong_role() -> tuple[int, Any]:
            async with aiohttp.ClientSession() as session:
                # signed (the signature is checked first: unsigned parameters are a 403), wrong role
                bad = ParamsSigner(SECRET).sign(KVTransferParams(transfer_id="t-bad", role=Role.DECODE))
                return await post(session, proc.url + "/v1/completions", greedy(
                    "hello", 1, kv_transfer_params=bad.to_dict()))

        status, error = run(wrong_role())  # a decode-side request sent to a prefill instance
        assert status == 400 and "not served by this prefill instance" in error["error"]["message"]
        assert error["error"]["param"] == "kv_transfer_params"

        out = run(body())
        params = out["kv_transfer_params"]
        assert params["transfer_id"] == "t-pull" and params["role"] == "decode"
        assert params["peer_endpoints"] == info.kv_endpoints
        assert params["first_token_id"] == out["choices"][0]["token_ids"][0]
        assert params["num_prompt_tokens"] == out["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 2.5  # < the 3 s lease: a heartbeat must show the held blocks
        held = router.next_message()
        while held.load.free_kv_blocks == held.load.total_kv_blocks:
            assert time.monotonic() < deadline, "no heartbeat reported the leased blocks"
            held = router.next_message()
        assert run(metric(proc.url, "kvwire_pd_blocks_awaiting_send")) > 0

        os.kill(proc.proc.pid, signal.SIGTERM)  # the lease ends with the process; deregister
        assert proc.proc.wait(timeout=15) == 0, proc.log()
        message = router.next_message()
        for _ in range(100):  # heartbeats sent before the stop may still be queued
            if not isinstance(message, Heartbeat):
                break
            message = router.next_message()
        assert isinstance(message, Deregister) and message.instance_id == "p-test"
        assert message.epoch == info.epoch
    finally:
        proc.stop()
        router.close()


def test_push_between_prefill_and_decode_servers_matches_colocated(
    server: ServerProcess, tmp_path: Path
) -> None:
    """Without a router: P and D get the two halves of one request by hand (what the router does)."""
    p = ServerProcess(tmp_path / "p.log", "--role", "prefill")
    d = ServerProcess(tmp_path / "d.log", "--role", "decode")
    try:
        p.wait_healthy()
        d.wait_healthy()
        p_kv, d_kv = (run(kv_endpoint(proc)) for proc in (p, d))
        prompt = "a prompt that spans more than one KV block of sixteen tokens"

        async def body() -> tuple[Any, Any, Any]:
            async with aiohttp.ClientSession() as session:
                p_req = greedy(prompt, 1, kv_transfer_params={
                    "transfer_id": "push-1", "role": "prefill", "peer_endpoints": [d_kv]})
                d_req = greedy(prompt, 10, stream=True, kv_transfer_params={
                    "transfer_id": "push-1", "role": "decode", "peer_endpoints": [p_kv]})
                p_out, d_out = await asyncio.gather(post(session, p.url + "/v1/completions", p_req),
                                                    post(session, d.url + "/v1/completions", d_req))
                ref = await post(session, server.url + "/v1/completions", greedy(prompt, 10))
            return p_out, d_out, ref

        (p_status, _), (d_status, d_raw), (_, ref) = run(body())
        assert p_status == 200 and d_status == 200
        d_ids = [t for c in sse_events(d_raw) for t in c["choices"][0]["token_ids"]]
        assert d_ids == ref["choices"][0]["token_ids"]
        # P frees its blocks once D acknowledged every layer (just after D's answer at the latest).
        for proc, side in ((p, "send"), (d, "recv")):
            run(until_metric(proc.url, f'kvwire_pd_transfers_completed_total{{side="{side}"}}', 1))
            run(until_metric(proc.url, "kvwire_kv_blocks_in_use", 0))
    finally:
        p.stop()
        d.stop()


async def kv_endpoint(proc: ServerProcess) -> str:
    """The transfer agent endpoint the instance shows on /health (what it advertises to a router)."""
    status, text = await get(proc.url + "/health")
    health = json.loads(text)
    assert status == 200 and health["role"] in ("prefill", "decode") and len(health["kv_endpoints"]) == 1
    return str(health["kv_endpoints"][0])
