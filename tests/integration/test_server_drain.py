"""SIGUSR1 drains ``kvwire serve`` (decision 120; what removing an instance of a Ray cluster does): it
deregisters at once, refuses new requests with 503 ``instance_stopping`` (a router re-dispatches
those), lets the stream in flight finish whole (and, on P, waits until the KV it holds for D has been
taken or its lease has ended), then stops with exit code 0."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
from test_server import FakeRouter, ServerProcess, greedy, metric, post, run, sse_events

from kvwire.discovery import Deregister, Heartbeat
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from kvwire.protocol.kv_signing import ParamsSigner
from support.waiting import wait_for

MAX_TOKENS = 1000  # seconds of decoding on tiny: the stream outlasts the signal's handling
SECRET = "s3cret-0123456789abcdef0123456789ab"  # kvwire serve needs 32+ bytes (decision 124)


def test_sigusr1_finishes_the_stream_in_flight_refuses_new_ones_and_stops(tmp_path: Path) -> None:
    router = FakeRouter(SECRET.encode())
    proc = ServerProcess(tmp_path / "serve.log", "--router", router.address, "--heartbeat-interval-s", "0.2",
                         "--instance-id", "drain-test", "--drain-timeout-s", "60",
                         "--max-model-len", "1024",
                         env={"KVWIRE_SECRET": SECRET})
    try:
        proc.wait_healthy()
        assert isinstance(router.next_message(), Heartbeat)

        async def body() -> tuple[bytes, int, Any]:
            async with aiohttp.ClientSession() as session:
                resp = await session.post(proc.url + "/v1/completions",
                                          json=greedy("abc", MAX_TOKENS, stream=True))
                first = await resp.content.readline()  # the stream is under way
                os.kill(proc.proc.pid, signal.SIGUSR1)
                status, refused = 0, None
                while status != 503:  # the signal is handled within an event-loop turn
                    status, refused = await post(session, proc.url + "/v1/completions", greedy("new", 2))
                return first + await resp.read(), status, refused

        raw, _, refused = run(body())
        assert refused["error"]["reason"] == "instance_stopping" and refused["error"]["code"] == 503
        events = sse_events(raw)
        assert not [e for e in events if "error" in e]
        tokens = sum(len(e["choices"][0].get("token_ids") or []) for e in events if e.get("choices"))
        assert tokens == MAX_TOKENS
        assert proc.proc.wait(timeout=60) == 0, proc.log()
        # the stream was under way (and maybe a "new" request sent before the signal was handled)
        assert re.search(r"draining [1-9]\d* request\(s\) in flight", proc.log()), proc.log()
        assert "drained: no request in flight" in proc.log()
        message = router.next_message()
        while isinstance(message, Heartbeat):  # heartbeats sent before the drain may still be queued
            message = router.next_message()
        assert isinstance(message, Deregister) and message.instance_id == "drain-test"
    finally:
        proc.stop()
        router.close()


LEASE_S = 6.0


def test_sigusr1_on_prefill_waits_for_the_kv_it_holds(tmp_path: Path) -> None:
    """Pull mode: P keeps a finished request's blocks for D under a lease; the drain waits for them."""
    router = FakeRouter(SECRET.encode())
    proc = ServerProcess(tmp_path / "serve.log", "--role", "prefill", "--router", router.address,
                         "--heartbeat-interval-s", "0.2", "--instance-id", "p-drain",
                         "--kv-deadline-s", str(LEASE_S), env={"KVWIRE_SECRET": SECRET})
    try:
        proc.wait_healthy()
        kv = ParamsSigner(SECRET).sign(KVTransferParams(
            transfer_id="t-drain", role=Role.PREFILL, mode=TransferMode.PULL)).to_dict()

        async def prefill() -> tuple[int, Any]:
            async with aiohttp.ClientSession() as session:
                return await post(session, proc.url + "/v1/completions",
                                  greedy("hello there", 1, kv_transfer_params=kv))

        started = time.monotonic()  # the lease starts later, when P finishes the prefill
        status, out = run(prefill())
        assert status == 200, out
        assert run(metric(proc.url, "kvwire_pd_blocks_awaiting_send")) > 0  # held for D's pull
        os.kill(proc.proc.pid, signal.SIGUSR1)
        wait_for(lambda: "draining 0 request(s) in flight" in proc.log(), 10, "the drain under way")
        assert proc.proc.poll() is None  # no request open, but the KV is still held: still draining
        assert run(metric(proc.url, "kvwire_pd_blocks_awaiting_send")) > 0
        assert proc.proc.wait(timeout=LEASE_S + 30) == 0, proc.log()
        assert time.monotonic() - started >= LEASE_S  # it waited for the lease to end (a lower bound)
        assert "drained: no request in flight" in proc.log()
    finally:
        proc.stop()
        router.close()
