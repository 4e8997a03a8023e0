"""/health is open (probes), but with API keys an instance's KV endpoints are shown only to a request
that carries one (decision 124)."""

from __future__ import annotations

from typing import Any

from kvwire.auth import ApiKeyConfig

IDENTITY = {"instance_id": "p0", "role": "prefill", "kv_endpoints": ["tcp://127.0.0.1:7001"]}
KEY = "sk-health-test-key"


def test_kv_endpoints_need_a_key_when_keys_are_set(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        anonymous = await (await server.client.get("/health")).json()
        assert anonymous["status"] == "ok" and anonymous["role"] == "prefill"
        assert "kv_endpoints" not in anonymous
        bad = {"Authorization": "Bearer sk-wrong-key-x"}
        wrong = await (await server.client.get("/health", headers=bad)).json()
        assert "kv_endpoints" not in wrong
        keyed = await (await server.client.get("/health", headers={"Authorization": f"Bearer {KEY}"})).json()
        assert keyed["kv_endpoints"] == IDENTITY["kv_endpoints"]

    run_with_fake_server(body, identity=IDENTITY, api_keys=ApiKeyConfig((KEY,)))


def test_without_keys_health_shows_them_as_before(run_with_fake_server: Any) -> None:
    async def body(server: Any) -> None:
        assert (await (await server.client.get("/health")).json())["kv_endpoints"] == IDENTITY["kv_endpoints"]

    run_with_fake_server(body, identity=IDENTITY)
