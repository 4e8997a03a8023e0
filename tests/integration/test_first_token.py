"""The first token from P, by default, with migration on (decision 121), through real processes.

A 1P1D push cluster with the router's defaults against a colocated instance: streamed completions and
chat, with and without ``return_token_ids`` and usage, are one well-formed stream (one id in every
event, one role chunk, no duplicate or missing token, usage counting every token) whose text and
token ids equal the colocated answer; the router opened the stream with P's token (its counter), and
sampled requests (temperature 1, no seed) are still one consistent stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.protocol.kv_params import TransferMode
from support.pd_cluster_helpers import ColocatedServer, metric, running_cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
PROMPTS = ["The capital of France", "Once upon a time there was", "1, 2, 3, 4,", "def main():"]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("first_token")


@pytest.fixture(scope="module")
def colocated(log_dir: Path) -> Iterator[str]:
    with open(log_dir / "colocated.log", "w") as sink:
        server = ColocatedServer(sink)
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture(scope="module")
def cluster(log_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_prefill=1, num_decode=1, mode=TransferMode.PUSH, heartbeat_interval_s=0.5)
    with running_cluster(spec, log_dir / "cluster.log") as pd:
        yield pd


def _body(chat: bool, prompt: str, *, stream: bool, ids: bool = False, usage: bool = False,
          temperature: float = 0.0) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": temperature,
                            "ignore_eos": True, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ids:
        body["return_token_ids"] = True
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


Answer = list[dict[str, Any]] | dict[str, Any]  # SSE events (streaming) or the JSON body


async def _post(url: str, chat: bool, body: dict[str, Any]) -> tuple[int, Answer]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        raw = await resp.read()
    if not body["stream"]:
        return resp.status, json.loads(raw)
    events = []
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if event.startswith(b"data:"):
            payload = event[5:].strip()
            events.append({"done": True} if payload == b"[DONE]" else json.loads(payload))
    return resp.status, events


def _text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return str((choice.get("delta") or choice.get("message") or {}).get("content") or "")
    return str(choice.get("text") or "")


def _check_stream(events: list[dict[str, Any]], chat: bool, *, usage: bool) -> tuple[str, list[int]]:
    """Assert one well-formed stream; its text and (when returned) token ids."""
    assert events and events[-1] == {"done": True}, events[-3:]
    body = events[:-1]
    assert all("error" not in e for e in body), body
    assert len({e["id"] for e in body}) == 1, [e["id"] for e in body]
    assert not any(k in e for e in body for k in ("kvwire_max_tokens",)), "router field leaked"
    roles = [e for e in body if e["choices"] and "role" in (e["choices"][0].get("delta") or {})]
    assert len(roles) == (1 if chat else 0)
    text, ids = "", []
    for e in body:
        if e["choices"]:
            text += _text(e["choices"][0], chat)
            ids += e["choices"][0].get("token_ids") or []
    finals = [e for e in body if e["choices"] and e["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    usages = [e["usage"] for e in body if e.get("usage")]
    if usage:
        assert len(usages) == 1 and usages[0]["completion_tokens"] == MAX_TOKENS, usages
    else:
        assert not usages
    return text, ids


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streams_equal_colocated_and_start_from_prefill(
    cluster: LocalCluster, colocated: str, chat: bool
) -> None:
    before = metric(cluster.router_url, "kvwire_router_first_tokens_from_prefill_total")

    async def scenario() -> None:
        for i, prompt in enumerate(PROMPTS):
            ids, usage = i % 2 == 0, i % 3 != 2
            status, ref = await _post(colocated, chat, _body(chat, prompt, stream=False, ids=True))
            assert status == 200, ref
            assert isinstance(ref, dict)
            ref_choice = ref["choices"][0]
            status, events = await _post(cluster.router_url, chat, _body(chat, prompt, stream=True, ids=ids,
                                                                         usage=usage))
            assert status == 200 and isinstance(events, list), events
            text, got_ids = _check_stream(events, chat, usage=usage)
            assert text == _text(ref_choice, chat), (prompt, text)
            if ids:
                assert got_ids == ref_choice["token_ids"], prompt
            else:
                assert not got_ids and not any("prompt_token_ids" in e for e in events)

    asyncio.run(scenario())
    spliced = metric(cluster.router_url, "kvwire_router_first_tokens_from_prefill_total") - before
    assert spliced >= len(PROMPTS) - 1  # P's answer may rarely lose the race to D's first token


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_sampled_streams_are_consistent(cluster: LocalCluster, chat: bool) -> None:
    """Temperature 1, no seed: P and D share the router's seed; the stream is whole either way (a D
    that drew another first token would have its answer continued from P's)."""

    async def scenario() -> None:
        for prompt in PROMPTS:
            status, events = await _post(cluster.router_url, chat, _body(
                chat, prompt, stream=True, ids=True, usage=True, temperature=1.0))
            assert status == 200 and isinstance(events, list), events
            _, ids = _check_stream(events, chat, usage=True)
            assert len(ids) == MAX_TOKENS

    asyncio.run(scenario())


def test_vllm_service_api_through_the_router(cluster: LocalCluster) -> None:
    """/tokenize, /detokenize, /version and /v1/models on the router answer what the instances do."""
    instance = next(i for i in cluster.live_instances() if i.role == "prefill")

    async def call(session: aiohttp.ClientSession, url: str, path: str, body: Any = None) -> tuple[int, Any]:
        method = session.get if body is None else session.post
        async with method(url + path, json=body) as resp:
            return resp.status, await resp.json()

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            for body in ({"model": "tiny", "prompt": "héllo world", "add_special_tokens": False},
                         {"prompt": "héllo"},
                         {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}):
                via_router = await call(session, cluster.router_url, "/tokenize", body)
                assert via_router == await call(session, str(instance.url), "/tokenize", body)
                status, answer = via_router
                assert status == 200 and answer["count"] == len(answer["tokens"]) > 0
            status, answer = await call(session, cluster.router_url, "/tokenize",
                                        {"prompt": "héllo world", "add_special_tokens": False})
            tokens = {"tokens": answer["tokens"]}
            status, text = await call(session, cluster.router_url, "/detokenize", tokens)
            assert (status, text) == (200, {"prompt": "héllo world"})
            status, err = await call(session, cluster.router_url, "/detokenize", {"tokens": [-1]})
            assert status == 400 and err["error"]["param"] == "tokens"
            _, models = await call(session, cluster.router_url, "/v1/models")
            _, own = await call(session, str(instance.url), "/v1/models")
            length = models["data"][0]["max_model_len"]
            assert length == own["data"][0]["max_model_len"] == answer["max_model_len"]
            _, version = await call(session, cluster.router_url, "/version")
            assert version == (await call(session, str(instance.url), "/version"))[1]

    asyncio.run(scenario())
