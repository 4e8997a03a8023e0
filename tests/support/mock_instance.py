"""A mock OpenAI upstream that heartbeats to a kvwire router, plus test helpers to run it.

Run as a process: ``python tests/support/mock_instance.py --router tcp://H:P --role both --id m0``
(``--router etcd://H:P`` registers in etcd instead);
it prints ``MOCK_READY <port>`` once serving. It answers at once with deterministic text
(``max_tokens`` tokens ``" t0 t1 ..."``), streaming or not, completions or chat. Directives in the
prompt (or the last chat message) change the behaviour:

* ``status=NNN`` -> HTTP NNN with an OpenAI-style error body naming this instance (429: with
  ``Retry-After: 1``, as a kvwire instance whose waiting queue is full);
* ``hang``       -> never answers (until the client goes away; the disconnect is recorded);
* ``slow``       -> 50 ms between streamed tokens;
* ``gap_ms=N``   -> N ms between streamed tokens (the stats record when each event was written);
* ``chunk_kb=N`` -> streaming: each token's text is padded with N KiB of ``x`` (fills socket buffers);
* ``delay``      -> wait 0.3 s before answering;
* ``drop``       -> streaming: close the connection after two tokens (an instance dying mid-stream);
* ``noparams``   -> a prefill instance in pull mode returns no ``kv_transfer_params``.

A directive prefixed with a role (``prefill.status=500``, ``decode.hang``) applies only to instances
of that role (words are separated by spaces).

Started with ``--token-ids``, answers to a request with ``return_token_ids`` carry ids: prompt
text characters are ids ``1000 + ord(c)``, token ``" tI"`` is id ``I``; a prompt of ids continues the
answer after its trailing ids below 1000 (a migrated stream goes on from the token it stopped at).

``GET /mock/stats`` returns every request received (path, body, arrival time), the disconnects seen
and the number of completed answers, so tests can check what the router sent and that a client
disconnect reached the upstream. Prefill instances (``--role prefill``) answer in pull mode with
``kv_transfer_params`` of their own.

Helpers for tests: :class:`MockProcess` (start/kill/stop one mock as a subprocess) and
:class:`RouterThread` (an in-process router on its own event loop thread).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from kvwire.cluster.process import ManagedProcess, wait_until
from kvwire.discovery import (
    EtcdRegistration,
    HeartbeatClient,
    InstanceInfo,
    InstanceLoad,
    parse_discovery_address,
)
from kvwire.protocol.kv_params import Role
from kvwire.router.config import Policy, RouterConfig

HERE = Path(__file__).resolve()
_SINK_LOCK = threading.Lock()  # mock output lines, prefixed, to stderr


class MockInstance:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.requests: list[dict[str, Any]] = []
        self.disconnects: list[dict[str, Any]] = []
        self.completed = 0
        self.active = 0
        self.kv_endpoint = f"tcp://127.0.0.1:{args.fake_kv_port}"

    def load(self) -> InstanceLoad:
        return InstanceLoad(num_running=self.active, num_waiting=0, free_kv_blocks=100, total_kv_blocks=100)

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/mock/stats", self.stats)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.args.model, "object": "model"}]})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"requests": self.requests, "disconnects": self.disconnects, "completed": self.completed}
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        record = {"path": request.path, "body": body, "received_at": time.time()}
        self.requests.append(record)
        self.active += 1
        try:
            response = await self._answer(request, body)
            self.completed += 1
            record["answered_at"] = time.time()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects.append({"path": request.path, "at": time.time(), "body": body})
            raise
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        text = _prompt_text(body)
        words = {w.split(".", 1)[1] if w.startswith(self.args.role + ".") else w for w in text.split()}
        status = next((int(w[7:]) for w in words if w.startswith("status=")), None)
        if status is not None:
            message = f"mock {self.args.id} says {status}"
            headers = {"Retry-After": "1"} if status == 429 else None  # a full waiting queue, like kvwire
            return web.json_response({"error": {"message": message, "code": status}}, status=status,
                                     headers=headers)
        if "hang" in words:
            await asyncio.sleep(3600)
        delay_s = self.args.delay_s + (0.3 if "delay" in words else 0.0)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        chat = request.path.endswith("/chat/completions")
        if body.get("stream"):
            return await self._stream(request, body, n, chat, words, delay_s)
        if delay_s:
            await asyncio.sleep(delay_s)
        return web.json_response(self._full(body, n, chat, words))

    def _full(self, body: dict[str, Any], n: int, chat: bool, words: set[str]) -> dict[str, Any]:
        start = _first_token(body)
        text = "".join(f" t{i}" for i in range(start, start + n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.args.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = list(range(start, start + n))
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out: dict[str, Any] = {
            "id": f"cmpl-{self.args.id}", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": self.args.model, "choices": [choice],
            "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
            "served_by": self.args.id,
        }
        if self.args.token_ids and body.get("return_token_ids"):
            out["prompt_token_ids"] = _prompt_ids(body)
        params = body.get("kv_transfer_params")
        pull = isinstance(params, dict) and params.get("mode") == "pull"
        if self.args.role == "prefill" and pull and "noparams" not in words:
            out["kv_transfer_params"] = dict(
                params, peer_endpoints=[self.kv_endpoint], first_token_id=42, num_prompt_tokens=5
            )
        return out

    async def _stream(
        self, request: web.Request, body: dict[str, Any], n: int, chat: bool, words: set[str], delay_s: float
    ) -> web.StreamResponse:
        """Like a real server: headers (and the chat role chunk) at once, tokens after ``delay_s``."""
        if self.args.drop_before_headers_s:
            await asyncio.sleep(self.args.drop_before_headers_s)
            assert request.transport is not None
            request.transport.close()
            return web.StreamResponse()
        gap_ms = next((int(w[7:]) for w in words if w.startswith("gap_ms=")), 50 if "slow" in words else 0)
        gap_s = gap_ms / 1000
        pad = "x" * 1024 * next((int(w[9:]) for w in words if w.startswith("chunk_kb=")), 0)
        emitted: list[float] = []  # when each token event was written (wall clock, for /mock/stats)
        self.requests[-1]["emitted_at"] = emitted
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": f"cmpl-{self.args.id}", "object": obj, "created": 0, "model": self.args.model}
        if chat:
            role_delta = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            await _event(resp, dict(base, choices=[role_delta]))
        if delay_s:
            await asyncio.sleep(delay_s)
        start = _first_token(body)
        ids = self.args.token_ids and bool(body.get("return_token_ids"))
        for i in range(start, start + n):
            if i == 2 and "drop" in words:
                assert request.transport is not None
                request.transport.close()  # die mid-stream: the chunked body never ends
                return resp
            if gap_s:
                await asyncio.sleep(gap_s)
            piece = f" t{i}{pad}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            choice["finish_reason"] = "length" if i == start + n - 1 else None
            event = dict(base, choices=[choice])
            if ids:
                choice["token_ids"] = [i]
                if i == start:
                    event["prompt_token_ids"] = _prompt_ids(body)
            await _event(resp, event)
            emitted.append(time.time())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            await _event(resp, dict(base, choices=[], usage=usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return [1000 + ord(c) for c in _prompt_text(body)]


def _first_token(body: dict[str, Any]) -> int:
    """The index of the first token to answer: after the trailing generated ids of a prompt of ids."""
    ids = _prompt_ids(body) if isinstance(body.get("prompt"), list) else []
    done = 0
    for t in reversed(ids):
        if t >= 1000:
            break
        done += 1
    return done


def _prompt_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        return str(messages[-1].get("content", ""))
    return ""


async def _main(args: argparse.Namespace) -> None:
    mock = MockInstance(args)
    runner = web.AppRunner(mock.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = runner.addresses[0][1]
    info = InstanceInfo(
        instance_id=args.id, role=Role(args.role), url=f"http://127.0.0.1:{port}",
        model=args.model, kv_endpoints=[mock.kv_endpoint], version="mock",
    )
    client: HeartbeatClient | EtcdRegistration
    if args.router.startswith("etcd://"):
        client = EtcdRegistration(parse_discovery_address(args.router), info, mock.load, args.interval_s,
                                  secret=args.secret)
    else:
        client = HeartbeatClient(args.router, info, mock.load, interval_s=args.interval_s, secret=args.secret)
    client.start()
    print(f"MOCK_READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    client.close()
    await runner.cleanup()


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--router", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--role", default="both", choices=[r.value for r in Role])
    p.add_argument("--model", default="mock")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--interval-s", type=float, default=0.2)
    p.add_argument("--secret", default=None)
    p.add_argument("--delay-s", type=float, default=0.0)
    # advertised, never listened on; a valid port, since the router refuses a kv endpoint without one
    p.add_argument("--fake-kv-port", type=int, default=7000)
    p.add_argument("--token-ids", action="store_true",
                   help="answer return_token_ids with ids, continue a prompt of ids (migration tests)")
    p.add_argument("--drop-before-headers-s", type=float, default=0.0,
                   help="streaming: wait this long, then close the connection before any header (an "
                        "instance dying before its first byte; 0: never)")
    return p.parse_args(argv)


# --- test helpers ---------------------------------------------------------------------------------


class MockProcess:
    """One mock instance as a subprocess; ``kill()`` is SIGKILL, ``stop()`` graceful (deregisters)."""

    def __init__(self, router: str, instance_id: str, *extra: str, ready_timeout_s: float = 20.0) -> None:
        self.instance_id = instance_id
        argv = [sys.executable, str(HERE), "--router", router, "--id", instance_id, *extra]
        self._managed = ManagedProcess(f"mock-{instance_id}", argv, sink=sys.stderr, sink_lock=_SINK_LOCK,
                                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.proc = self._managed.proc
        self.port = self._wait_ready(ready_timeout_s)
        self.url = f"http://127.0.0.1:{self.port}"

    def _ready_port(self) -> int | None:
        for line in self._managed.output().splitlines():
            if line.startswith("MOCK_READY"):
                return int(line.split()[1])
        return None

    def _wait_ready(self, timeout_s: float) -> int:
        wait_until(lambda: self._ready_port() is not None or self.proc.poll() is not None, timeout_s, 0.02)
        port = self._ready_port()
        if port is None:
            self.kill()
            raise RuntimeError(f"mock {self.instance_id} did not start (rc={self.proc.poll()}):\n"
                               f"{self._managed.output()[-2000:]}")
        return port

    def kill(self) -> None:
        self._managed.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        self._managed.stop(grace_s=10.0)

    def stats(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/mock/stats", timeout=5) as resp:
            out: dict[str, Any] = json.loads(resp.read())
        return out


class RouterThread:
    """A :class:`kvwire.router.app.RouterServer` on its own event loop in a daemon thread."""

    def __init__(self, cfg: Any) -> None:
        from kvwire.router.app import RouterServer

        self.server = RouterServer(cfg)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=20)
        self.port = self.server.port
        self.url = self.server.url
        self.discovery = self.server.discovery_address

    def close(self, grace_s: float = 3.0) -> None:
        """Stop the router and its loop thread. Idempotent (tests may close early and again in finally)."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self._loop).result(timeout=20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def router_config(**kw: Any) -> RouterConfig:
    """Test router: free ports, 0.6 s TTL (3 x 0.2 s heartbeats), round robin, 64 KiB body limit."""
    base: dict[str, Any] = dict(
        port=0, discovery_port=0, instance_ttl_s=0.6, policy=Policy.ROUND_ROBIN, max_body_bytes=64 * 1024
    )
    base.update(kw)
    return RouterConfig(**base)


def post(url: str, path: str, body: Any, *, raw: bytes | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get(url: str, path: str) -> Any:
    status, data = get_raw(url, path)
    assert status == 200, data
    return json.loads(data)


def get_raw(url: str, path: str) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def live_ids(router: RouterThread) -> set[str]:
    return {v.instance_id for v in router.server.registry.snapshot() if v.alive}


MockSpec = tuple[str, str, list[str]]  # (instance id, role, extra mock_instance.py flags)

# A prefill + decode pair serving model ``mock`` and a colocated instance serving ``solo``, so one
# router covers both dispatch plans.
PD_AND_SOLO: list[MockSpec] = [
    ("p0", "prefill", ["--model", "mock"]),
    ("d0", "decode", ["--model", "mock"]),
    ("b0", "both", ["--model", "solo"]),
]


class MockCluster:
    """A router (in-process) and mock instances (processes), all stopped by :meth:`close`."""

    def __init__(self, specs: list[MockSpec], **router_kw: Any) -> None:
        self.router = RouterThread(router_config(**router_kw))
        self.url = self.router.url
        self.mocks: dict[str, MockProcess] = {}
        try:
            for ident, role, extra in specs:
                self.mocks[ident] = MockProcess(
                    self.router.discovery, ident, "--role", role, "--interval-s", "0.2", *extra
                )
            from support.waiting import wait_for  # lazy: this file also runs as a script

            wait_for(lambda: live_ids(self.router) >= set(self.mocks), 10, "mocks registered")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for mock in self.mocks.values():
            mock.kill()
        self.router.close()

    def count(self, ident: str, key: str) -> int:
        value = self.mocks[ident].stats()[key]
        return len(value) if isinstance(value, list) else int(value)

    def metric(self, line_prefix: str) -> float:
        text = get_raw(self.url, "/metrics")[1].decode()
        for line in text.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_all_live(self) -> None:
        from support.waiting import wait_for  # lazy: this file also runs as a script

        wait_for(lambda: live_ids(self.router) >= set(self.mocks), 10, "every mock live again")




if __name__ == "__main__":
    asyncio.run(_main(_parse()))
