"""API keys: header parsing, key checks, configuration, refusal logging; router credentials."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from kvwire.errors import ConfigError
from kvwire.http.front_door import ApiKeyConfig, Refusal, api_key_middleware, bearer_token, keys_from_cli
from kvwire.http.refusal_log import RefusalLog
from kvwire.router.app import instance_headers
from kvwire.router.config import RouterConfig

KEYS = ApiKeyConfig(("sk-first-key", "sk-second-key"), frozenset({"/metrics"}))


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None), (None, None),
    ("", None),
])
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_check_accepts_every_configured_key_and_says_why_not() -> None:
    assert KEYS.check("Bearer sk-first-key") is None
    assert KEYS.check("Bearer sk-second-key") is None
    assert KEYS.check("Bearer sk-first-ke") is Refusal.WRONG_KEY
    assert KEYS.check(None) is Refusal.MISSING_KEY
    assert KEYS.check("sk-first-key") is Refusal.MISSING_KEY  # no scheme


def test_open_paths() -> None:
    assert KEYS.is_open("/health") and KEYS.is_open("/metrics")
    assert not KEYS.is_open("/v1/completions") and not KEYS.is_open("/instances")
    assert ApiKeyConfig().is_open("/v1/completions")  # no keys: nothing protected


def test_keys_come_from_flags_else_the_environment() -> None:
    assert keys_from_cli(["sk-a-long-key"], {"KVWIRE_API_KEY": "sk-env-key"}) == ("sk-a-long-key",)
    assert keys_from_cli(None, {"KVWIRE_API_KEY": "sk-env-key"}) == ("sk-env-key",)
    assert keys_from_cli(None, {}) == ()
    with pytest.raises(ConfigError):
        ApiKeyConfig(("short",))


def test_refusals_are_logged_once_per_reason_then_summarized(caplog: pytest.LogCaptureFixture) -> None:
    logbook = RefusalLog(logging.getLogger("test.refusals"), "request", interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(50):
            logbook.refused("wrong_api_key", "x")
        logbook.refused("missing_api_key", "y")
    assert len(caplog.records) == 2


def test_router_sends_its_own_key_and_never_the_clients_router_key() -> None:
    client = {"Content-Type": "application/json", "Authorization": "Bearer sk-client-key"}
    own = RouterConfig(api_keys=ApiKeyConfig(("sk-client-key",)), instance_api_key="sk-instance-key")
    assert instance_headers(client, own)["Authorization"] == "Bearer sk-instance-key"
    keyed = RouterConfig(api_keys=ApiKeyConfig(("sk-client-key",)))
    assert "Authorization" not in instance_headers(client, keyed)
    assert instance_headers(client, RouterConfig())["Authorization"] == "Bearer sk-client-key"  # pass-through


def _parse(argv: list[str]) -> object:
    from kvwire.cli import build_parser

    return build_parser(argv).parse_args(argv)


def test_cli_flags_become_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwire.cluster.cli import spec_from_args
    from kvwire.router.cli import config_from_args
    from kvwire.server.cli import server_config_from_args

    monkeypatch.setenv("KVWIRE_API_KEY", "sk-from-the-env")
    monkeypatch.setenv("KVWIRE_INSTANCE_API_KEY", "sk-instance-env")
    router = config_from_args(_parse(["router", "--api-key", "sk-router-one", "--api-key", "sk-router-two",
                                      "--open-endpoint", "metrics"]))  # type: ignore[arg-type]
    assert router.api_keys.keys == ("sk-router-one", "sk-router-two")
    assert router.api_keys.open_paths == frozenset({"/metrics"})
    assert router.instance_api_key == "sk-instance-env"
    serve = server_config_from_args(_parse(["serve"]))  # type: ignore[arg-type]
    assert serve.api_keys.keys == ("sk-from-the-env",) and not serve.api_keys.open_paths
    up = spec_from_args(_parse(["up"]))  # type: ignore[arg-type]
    assert up.api_key == "sk-from-the-env"


def test_a_key_that_is_not_utf8_is_a_401_not_a_500() -> None:
    """aiohttp decodes header values with surrogateescape: such a token is compared as its bytes and
    refused like any wrong key (the check raised UnicodeEncodeError: a 500 before any handler)."""
    assert KEYS.check(b"Bearer sk-\xff\xfe".decode("utf-8", "surrogateescape")) is Refusal.WRONG_KEY
    utf8 = ApiKeyConfig(("sk-caf\u00e9-key",))
    assert utf8.check("Bearer sk-caf\u00e9-key") is None

    async def scenario() -> bytes:
        refused: list[Refusal] = []
        app = web.Application(middlewares=[api_key_middleware(KEYS, refused.append)])

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app.router.add_get("/v1/models", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-\xff\xfe\r\n"
                         b"Connection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
        finally:
            await runner.cleanup()
        assert refused == [Refusal.WRONG_KEY]
        return answer

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 401")
