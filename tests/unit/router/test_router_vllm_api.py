"""vLLM's service API on the router: model cards with max_model_len, /version, /tokenize forwarding
errors, and the warning for an instance configured with a mode the router overrides (decision 122)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest

from kvwire import __version__
from kvwire.discovery import Heartbeat, InstanceInfo
from kvwire.protocol.kv_params import Role, TransferMode
from kvwire.router.app import RouterServer
from kvwire.router.config import RouterConfig
from kvwire.router.registry import Registry
from kvwire.router.vllm_api import mode_overridden, model_cards, warn_if_overridden


def info(ident: str, role: Role = Role.PREFILL, kv_mode: str = "", max_len: int = 0,
         model: str = "m") -> InstanceInfo:
    return InstanceInfo(instance_id=ident, role=role, url=f"http://127.0.0.1:1/{ident}", model=model,
                        kv_mode=kv_mode, max_model_len=max_len)


def test_model_cards_take_the_smallest_announced_length() -> None:
    reg = Registry(ttl_s=10.0)
    for seq, i in enumerate([info("a", max_len=2048), info("b", Role.DECODE, max_len=1024),
                             info("c", Role.BOTH, model="n")], 1):
        reg.apply(Heartbeat(info=i, seq=seq))
    cards = {c["id"]: c for c in model_cards(reg.snapshot())["data"]}
    assert cards["m"]["max_model_len"] == 1024 and cards["n"]["max_model_len"] is None
    assert set(cards["m"]) >= {"id", "object", "created", "owned_by", "root", "parent", "permission"}


def test_overridden_mode_warned_once_per_registration(caplog: pytest.LogCaptureFixture) -> None:
    reg = Registry(ttl_s=10.0, on_register=lambda i: warn_if_overridden(i, TransferMode.PUSH))
    with caplog.at_level(logging.WARNING, logger="kvwire.router.vllm_api"):
        p = info("p", kv_mode="pull")
        for seq in (1, 2, 3):  # heartbeats of one process: one warning
            reg.apply(Heartbeat(info=p, seq=seq))
        reg.apply(Heartbeat(info=info("d", Role.DECODE, kv_mode="push"), seq=1))  # agrees: none
        reg.apply(Heartbeat(info=info("e", Role.DECODE), seq=1))  # not configured: none
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "instance p" in warnings[0] and "pull" in warnings[0], warnings
    assert mode_overridden(info("p", kv_mode="pull"), TransferMode.PUSH)
    assert not mode_overridden(info("p", kv_mode="pull"), TransferMode.PULL)
    assert not mode_overridden(info("b", Role.BOTH, kv_mode="pull"), TransferMode.PUSH)


async def _with_router(check: Any) -> None:
    server = RouterServer(RouterConfig(port=0, discovery_port=0, mode=TransferMode.PUSH))
    await server.start()
    try:
        server.registry.apply(Heartbeat(info=info("p", kv_mode="pull", max_len=512), seq=1))
        # a decode instance too: /v1/models lists a model only when it can be served (decision 124)
        server.registry.apply(Heartbeat(info=info("q", Role.DECODE, max_len=512), seq=1))
        async with aiohttp.ClientSession() as session:
            await check(server, session)
    finally:
        await server.stop()


def test_router_endpoints() -> None:
    async def check(server: RouterServer, session: Any) -> None:
        async with session.get(server.url + "/instances") as resp:
            entry = (await resp.json())[0]
        assert entry["kv_mode"] == "pull" and entry["kv_mode_overridden"] is True
        assert entry["max_model_len"] == 512
        async with session.get(server.url + "/version") as resp:
            assert (await resp.json()) == {"version": __version__}
        async with session.get(server.url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["max_model_len"] == 512
        async with session.post(server.url + "/tokenize", json={"model": "other", "prompt": "x"}) as resp:
            err = (await resp.json())["error"]
            assert resp.status == 404 and err["code"] == 404 and err["type"] == "NotFoundError"
        async with session.post(server.url + "/detokenize", data=b"[1]") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] is None
        # the only instance does not listen: 502 in the same body shape
        async with session.post(server.url + "/tokenize", json={"model": "m", "prompt": "x"}) as resp:
            err = (await resp.json())["error"]
            assert resp.status == 502 and err["code"] == 502, err

    asyncio.run(_with_router(check))


def test_vllm_plugin_announces_only_a_configured_mode() -> None:
    from kvwire.integrations.vllm_config import VllmTransferView, plugin_config_from_vllm

    def mode(**extra: Any) -> TransferMode | None:
        view = VllmTransferView(kv_role="kv_producer", kv_connector_extra_config=extra)
        return plugin_config_from_vllm(view).configured_mode

    assert mode(send_type="GET") is TransferMode.PULL  # the seed's pull, overridden by a push router
    assert mode(send_type="PUT_ASYNC") is TransferMode.PUSH
    assert mode(mode="pull") is TransferMode.PULL
    assert mode() is None  # not configured: follows the router, never warned about
