"""The router's asyncio components under supervision (the etcd watch and expiry tasks), the etcd
watch stream's bounds, and the router's bound flags (decision 117)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import pytest

from kvwire.discovery.address import parse_discovery_address
from kvwire.discovery.etcd_gateway import EtcdError
from kvwire.errors import ConfigError
from kvwire.router import etcd_stream
from kvwire.router.cli import add_arguments, config_from_args
from kvwire.router.etcd_stream import decode_watch_message, watch_messages
from kvwire.router.etcd_watcher import EtcdWatcher
from kvwire.router.registry import Registry
from kvwire.supervision import HealthBoard, RestartPolicy, supervise_async

FAST = RestartPolicy(max_restarts=2, window_s=60.0, backoff_initial_s=0.001, backoff_max_s=0.002)


def test_supervise_async_restarts_a_failing_body_and_stops_on_cancel() -> None:
    board = HealthBoard()
    runs: list[int] = []

    async def body() -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise RecursionError("hostile")
        await asyncio.sleep(60)

    async def main() -> None:
        task = asyncio.create_task(supervise_async("kvwire-test-task", body, board=board, policy=FAST))
        while len(runs) < 3:
            await asyncio.sleep(0.001)
        assert board.restarts() == {"kvwire-test-task": 2} and board.dead() == []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert board.snapshot() == []  # stopped on purpose: off the board

    asyncio.run(asyncio.wait_for(main(), 30))


def test_supervise_async_gives_up_and_the_board_names_it() -> None:
    board = HealthBoard()

    async def body() -> None:
        raise ValueError("always")

    asyncio.run(asyncio.wait_for(supervise_async("kvwire-test-task", body, board=board, policy=FAST), 30))
    [dead] = board.dead()
    assert dead.name == "kvwire-test-task" and dead.last_error == "ValueError: always"


def test_an_unexpected_watch_failure_is_restarted_and_marks_the_view_stale() -> None:
    board = HealthBoard()
    watcher = EtcdWatcher(Registry(ttl_s=5.0), parse_discovery_address("etcd://127.0.0.1:9"), board=board)
    calls: list[int] = []

    async def sync() -> int:
        calls.append(1)
        raise KeyError("header")  # an etcd answer without the field the watcher reads

    watcher._sync = sync  # type: ignore[method-assign]

    async def main() -> None:
        await watcher.start()
        try:
            while board.restarts().get("kvwire-etcd-watch", 0) < 1:
                await asyncio.sleep(0.01)
            assert watcher.stale and "KeyError" in watcher.last_error
        finally:
            await watcher.stop()
        assert board.snapshot() == []

    asyncio.run(asyncio.wait_for(main(), 30))


class _Stream:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


def test_a_watch_message_over_the_cap_is_an_etcd_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_stream, "MAX_WATCH_MESSAGE_BYTES", 1000)

    async def read(chunks: list[bytes]) -> int:
        return len([m async for m in watch_messages(_Stream(chunks))])  # type: ignore[arg-type]

    assert asyncio.run(read([b'{"result": {}}\n', b'{"result"', b": {}}\n"])) == 2
    with pytest.raises(EtcdError, match="over 1000 bytes"):
        asyncio.run(read([b"x" * 600, b"y" * 600]))


def test_a_nested_watch_message_is_an_etcd_error() -> None:
    with pytest.raises(EtcdError, match="not a watch message"):
        decode_watch_message(b'{"error": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")


def test_router_bound_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([]))
    assert (cfg.max_instances, cfg.max_record_ttl_s) == (10_000, 60.0)
    assert (cfg.upstream_max_connections, cfg.upstream_max_connections_per_instance) == (4096, 1024)
    cfg = config_from_args(parser.parse_args([
        "--max-instances", "3", "--max-record-ttl-s", "9", "--upstream-max-connections", "8",
        "--upstream-max-connections-per-instance", "2"]))
    assert (cfg.max_instances, cfg.max_record_ttl_s) == (3, 9.0)
    assert (cfg.upstream_max_connections, cfg.upstream_max_connections_per_instance) == (8, 2)
    for bad in (["--max-instances", "0"], ["--max-record-ttl-s", "inf"], ["--max-record-ttl-s", "nan"]):
        with pytest.raises(ConfigError, match="must be"):
            config_from_args(parser.parse_args(bad))


def test_a_nested_etcd_record_is_a_protocol_error_and_a_nested_answer_an_etcd_error() -> None:
    from kvwire.discovery.etcd_gateway import check_answer, decode_record
    from kvwire.errors import ProtocolError

    nested = b'{"type": "heartbeat", "junk": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    with pytest.raises(ProtocolError, match="RecursionError"):
        decode_record(nested)  # anyone who may write the prefix could put it there
    with pytest.raises(EtcdError, match="not JSON"):
        check_answer("/v3/kv/range", 200, b"[" * 100_000 + b"]" * 100_000)


def test_a_probe_that_raises_is_counted_not_silent() -> None:
    board = HealthBoard()
    watcher = EtcdWatcher(Registry(ttl_s=5.0), parse_discovery_address("etcd://127.0.0.1:9"), board=board)

    async def probe() -> None:
        raise AttributeError("'list' object has no attribute 'get'")  # an answer of another shape

    async def main() -> None:
        task = asyncio.create_task(probe())
        watcher.expiry.in_flight.add(task)
        task.add_done_callback(watcher.expiry.probe_done)
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the done callback runs on the next loop iteration

    asyncio.run(main())
    assert watcher.probes["failed"] == 1 and not watcher.expiry.in_flight
    assert board.worker_errors() == {"kvwire-etcd-probe": 1}
