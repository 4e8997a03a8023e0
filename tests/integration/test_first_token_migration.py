"""A decode instance that dies before its first byte, after P's first token went to the client:
the stream continues after P's token on another decode instance (migration), not with an error."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from support.mock_instance import MockProcess, RouterThread, get_raw, live_ids, post, router_config
from support.waiting import wait_for


@pytest.fixture
def router() -> Iterator[RouterThread]:
    thread = RouterThread(router_config(instance_ttl_s=1.0))
    try:
        yield thread
    finally:
        thread.close()


def _text(sse: bytes) -> tuple[str, list[str]]:
    text, errors = "", []
    for line in sse.split(b"\n"):
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        event = msgspec.json.decode(line[5:].strip())
        if "error" in event:
            errors.append(str(event["error"]))
        for choice in event.get("choices", []):
            text += choice.get("text") or ""
    return text, errors


def test_decode_lost_before_its_first_byte_migrates_after_the_prefill_token(router: RouterThread) -> None:
    # d0 closes every stream 1 s after the request, before any header: P's token (answered at once)
    # is out by then. d1 serves normally.
    ids = "--token-ids"  # the ledger needs token ids to continue a stream
    mocks = [MockProcess(router.discovery, "p0", "--role", "prefill", ids),
             MockProcess(router.discovery, "d0", "--role", "decode", ids, "--drop-before-headers-s", "1.0"),
             MockProcess(router.discovery, "d1", "--role", "decode", ids)]
    try:
        wait_for(lambda: live_ids(router) == {"p0", "d0", "d1"}, 20, "all three live")
        expected = "".join(f" t{i}" for i in range(6))
        for _ in range(2):  # round robin: one of the two goes to d0
            wait_for(lambda: live_ids(router) == {"p0", "d0", "d1"}, 20, "d0 back after its drop")
            status, body = post(router.url, "/v1/completions",
                                {"model": "mock", "prompt": "hello", "max_tokens": 6, "stream": True})
            text, errors = _text(body)
            assert status == 200 and errors == [], body[-500:]
            assert text == expected  # P's " t0" once, then the rest from the instance that continued
        _, metrics = get_raw(router.url, "/metrics")
        assert b'kvwire_router_first_tokens_from_prefill_total' in metrics
        assert b'kvwire_router_migrations_total{kind="stream"} 0.0' not in metrics, metrics.decode()[-3000:]
        assert b'kvwire_router_migrations_total{kind="stream"}' in metrics
    finally:
        for mock in mocks:
            mock.kill()
