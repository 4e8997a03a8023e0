"""Fixtures of the server unit tests; the fake engine and server live in
tests/support/fake_engine_server.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support.fake_engine_server import FakeEngine, FakeServer, start_fake_server, stop_fake_server


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def run_with_fake_server() -> Iterator[Callable[..., Any]]:
    """Runs ``async def body(server: FakeServer)`` against a fresh fake-engine server."""

    def run(body: Callable[[FakeServer], Any], engine: FakeEngine | None = None, **kw: Any) -> Any:
        async def main() -> Any:
            server = await start_fake_server(engine or FakeEngine(), **kw)
            try:
                return await asyncio.wait_for(body(server), timeout=30)
            finally:
                await stop_fake_server(server)

        return asyncio.run(main())

    yield run
