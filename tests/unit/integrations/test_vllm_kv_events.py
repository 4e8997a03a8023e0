"""vLLM's KV events -> kvwire hashes (kvwire.integrations.vllm_kv_events), without vLLM: batches are
built in vLLM's wire format (msgpack ``[ts, events, dp_rank]``, events as maps tagged by ``type``,
frames ``(topic, seq, payload)``); the vLLM tier checks the same path against a real vLLM."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

from kvwire.connector.config import EngineInfo
from kvwire.integrations.vllm_config import VllmTransferView, plugin_config_from_vllm
from kvwire.integrations.vllm_kv_events import (
    VllmKvEventBridge,
    VllmKvEventsSource,
    VllmKvTranslator,
    decode_events,
    kv_events_source,
    subscribe_endpoint,
)
from kvwire.integrations.vllm_scheduler_side import Identity, RankEndpoint, SchedulerSide
from kvwire.protocol.kv_blocks import KvEventLog, block_hashes
from kvwire.router.listener import DiscoveryListener
from kvwire.router.registry import KvIndex, Registry
from kvwire.supervision import HealthBoard
from support.waiting import wait_for

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4


def vh(i: int) -> bytes:
    """A vLLM-style block hash (sha256 bytes); unrelated to kvwire's on purpose."""
    return hashlib.sha256(f"vllm-{i}".encode()).digest()


def stored(first: int, count: int, parent: bytes | None, **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [vh(first + i) for i in range(count)],
            "parent_block_hash": parent, "token_ids": TOKENS[first * BS : (first + count) * BS],
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def removed(*blocks: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [vh(b) for b in blocks], "medium": "GPU"}


def payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), 0])


def translate(*events: dict[str, Any]) -> tuple[VllmKvTranslator, KvEventLog]:
    log = KvEventLog(BS)
    translator = VllmKvTranslator(log)
    decoded, unknown = decode_events(payload(*events))
    assert unknown == 0
    translator.apply(decoded)
    return translator, log


def announced(log: KvEventLog) -> set[int]:
    batch = log.drain()
    return set() if batch is None else set(batch.stored) - set(batch.removed)


def test_stored_blocks_get_kvwire_chain_hashes_across_events() -> None:
    translator, log = translate(stored(0, 2, None), stored(2, 3, vh(1)))  # a later step extends it
    assert announced(log) == set(block_hashes(TOKENS[: 5 * BS], BS))
    assert translator.num_blocks == 5


def test_removed_and_cleared() -> None:
    translator, log = translate(stored(0, 3, None))
    log.drain()
    translator.apply(decode_events(payload(removed(2, 9)))[0])  # 9: never forwarded, ignored
    batch = log.drain()
    assert batch is not None and batch.removed == [block_hashes(TOKENS, BS)[2]] and not batch.stored
    translator.apply(decode_events(payload({"type": "AllBlocksCleared"}))[0])
    batch = log.drain()
    assert batch is not None and set(batch.removed) == set(block_hashes(TOKENS, BS)[:2])
    assert translator.num_blocks == 0 and log.num_cached_blocks == 0


def test_reannounced_block_is_counted_once() -> None:
    translator, log = translate(stored(0, 2, None), stored(0, 2, None))  # kv_cache_report_mode "full"
    assert len(announced(log)) == 2
    translator.apply(decode_events(payload(removed(0, 1)))[0])
    assert log.num_cached_blocks == 0


def test_blocks_with_extra_keys_and_their_descendants_are_not_forwarded() -> None:
    # a cache_salt on block 1: block 0 is forwarded, 1 and 2 are not, nor a later child of 2
    translator, log = translate(stored(0, 3, None, extra_keys=[None, ["salt"], None]), stored(3, 1, vh(2)))
    assert announced(log) == {block_hashes(TOKENS, BS)[0]}
    assert translator.skipped == {"extra_keys": 2, "unknown_parent": 1}


@pytest.mark.parametrize(
    ("extra", "reason"),
    [({"medium": "CPU"}, "medium"), ({"lora_name": "adapter"}, "lora"), ({"group_idx": 1}, "group"),
     ({"block_size": 2}, "partial")],
)
def test_other_tiers_adapters_groups_and_partial_blocks_skipped(extra: dict[str, Any], reason: str) -> None:
    translator, log = translate(stored(0, 2, None, **extra))
    assert announced(log) == set()
    assert translator.skipped == {reason: 2}


def test_unknown_event_types_are_skipped_not_fatal() -> None:
    events, unknown = decode_events(payload({"type": "SomethingNew", "x": 1}, stored(0, 1, None)))
    assert unknown == 1 and len(events) == 1
    with pytest.raises(msgspec.ValidationError):
        decode_events(msgspec.msgpack.encode({"not": "a batch"}))


@pytest.mark.parametrize(
    ("configured", "rank", "expected"),
    [("tcp://*:5557", 0, "tcp://127.0.0.1:5557"), ("tcp://0.0.0.0:6000", 2, "tcp://127.0.0.1:6002"),
     ("tcp://[::]:7000", 0, "tcp://[::1]:7000"), ("ipc:///tmp/ev", 0, "ipc:///tmp/ev"),
     ("inproc://ev", 1, "inproc://ev_dp1"), ("tcp://10.0.0.5:5557", 0, None), ("tcp://*:0", 0, None),
     ("udp://x:1", 0, None)],
)
def test_subscribe_endpoint(configured: str, rank: int, expected: str | None) -> None:
    assert subscribe_endpoint(configured, rank) == expected


def test_kv_events_source_reads_vllms_config() -> None:
    on = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5600", topic="kv")
    assert kv_events_source(on) == VllmKvEventsSource("tcp://127.0.0.1:5600", "kv")
    assert kv_events_source(None) is None
    assert kv_events_source(SimpleNamespace(enable_kv_cache_events=False, publisher="null")) is None
    assert kv_events_source(SimpleNamespace(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint="tcp://10.0.0.5:5557")) is None


class Publisher:
    """vLLM's side: frames (topic, seq, payload) on a bound socket. XPUB, so that the test can wait
    for the subscription instead of sleeping (a PUB drops what it sends before a SUB joined)."""

    def __init__(self, topic: bytes = b"") -> None:
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.topic = topic

    def await_subscriber(self) -> None:
        assert self.sock.poll(5000), "no subscriber joined"
        assert self.sock.recv()[:1] == b"\x01"

    def send(self, seq: int, *events: dict[str, Any]) -> None:
        self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload(*events)])

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher(b"kv")
    yield pub
    pub.close()


def test_bridge_subscribes_translates_and_counts_gaps(publisher: Publisher) -> None:
    log = KvEventLog(BS)
    bridge = VllmKvEventBridge(f"tcp://127.0.0.1:{publisher.port}", VllmKvTranslator(log), "kv").start()
    try:
        publisher.await_subscriber()
        publisher.send(0, stored(0, 2, None))
        wait_for(lambda: log.num_cached_blocks == 2, 5, "the first batch")
        publisher.send(2, stored(2, 1, vh(1)))  # batch 1 lost
        wait_for(lambda: log.num_cached_blocks == 3, 5, "the batch after the gap")
        assert bridge.gaps == 1 and bridge.batches == 2
    finally:
        bridge.close()
    assert bridge._thread is not None and not bridge._thread.is_alive()


@pytest.fixture
def http_port() -> Iterator[int]:
    """An HTTP server answering 404 to everything: the plugin registers once its instance answers."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_scheduler_side_forwards_vllm_events_to_the_index(publisher: Publisher, http_port: int) -> None:
    """The plugin's scheduler half, a real router listener and KV index: vLLM's events arrive as
    kvwire hashes that match the router's own hashing of the prompt, and announce the tokenizer."""
    index = KvIndex()
    registry = Registry(ttl_s=30.0, on_remove=index.drop)
    listener = DiscoveryListener(registry, "127.0.0.1", 0, kv_index=index).start()
    extra = {"router": listener.address, "http_host": "127.0.0.1", "http_port": http_port,
             "heartbeat_interval_s": 0.05}
    config = plugin_config_from_vllm(VllmTransferView(kv_role="kv_consumer", kv_connector_extra_config=extra))
    source = VllmKvEventsSource(f"tcp://127.0.0.1:{publisher.port}", "kv")
    side = SchedulerSide(config, EngineInfo(block_size=BS), Identity("vllm-d", "tiny", "vllm", "/models/t"),
                         source)
    try:
        side.set_endpoints([RankEndpoint(0, "tcp://127.0.0.1:7100", "agent-a")])
        publisher.await_subscriber()
        publisher.send(0, stored(0, 4, None))
        wait_for(lambda: registry.get("vllm-d") is not None, 10, "registration")
        view = registry.get("vllm-d")
        assert view is not None and view.info.tokenizer == "/models/t"
        prompt = TOKENS[: 4 * BS + 2]
        wait_for(lambda: index.match(["vllm-d"], lambda bs: block_hashes(prompt, bs)) == {"vllm-d": 4}, 10,
                 "the index to hold the prompt's 4 blocks")
        assert index.block_size("vllm-d") == BS
        names = {status.name for status in side.board.snapshot()}
        assert {"kvwire-vllm-kv-events", "kvwire-heartbeat"} <= names  # supervised on the side's board
    finally:
        side.close()
        listener.close()
    assert side.kv_bridge is not None and side.kv_bridge._thread is not None
    assert not side.kv_bridge._thread.is_alive()


def test_bridge_survives_a_nested_batch_and_a_failing_translator(publisher: Publisher) -> None:
    log = KvEventLog(BS)
    translator = VllmKvTranslator(log)
    board = HealthBoard()
    real_apply = translator.apply
    failures = [RuntimeError("injected")]

    def apply_once_failing(events: Any) -> None:
        if failures:
            raise failures.pop()
        real_apply(events)

    translator.apply = apply_once_failing  # type: ignore[method-assign]
    bridge = VllmKvEventBridge(f"tcp://127.0.0.1:{publisher.port}", translator, "kv", board=board).start()
    try:
        publisher.await_subscriber()
        publisher.send(0, stored(0, 1, None))  # the translator raises: the bridge restarts
        wait_for(lambda: board.restarts().get("kvwire-vllm-kv-events") == 1, 10, "the bridge restarted")
        while publisher.sock.poll(10_000) and publisher.sock.recv()[:1] != b"\x01":
            pass  # the failed body's unsubscription, then the restarted body's subscription
        nested = b"\x93\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00" + b"\x91" * 60_000 + b"\x90\x00"
        publisher.sock.send_multipart([b"kv", (1).to_bytes(8, "big"), nested])
        wait_for(lambda: bridge.malformed == 1, 10, "the nested batch counted as malformed")
        publisher.send(2, stored(1, 1, None))
        wait_for(lambda: log.num_cached_blocks == 1, 10, "a batch applied after both")
        assert board.dead() == []
    finally:
        bridge.close()
    assert board.snapshot() == []


def test_scheduler_side_logs_a_dead_component_once(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's health check cannot read the plugin's board: a dead registration or KV-event thread is
    logged as an error at the next scheduler step, once."""
    config = plugin_config_from_vllm(VllmTransferView(kv_role="kv_consumer", kv_connector_extra_config={}))
    side = SchedulerSide(config, EngineInfo(block_size=BS), Identity("vllm-d", "tiny", "vllm", "/models/t"))
    try:
        side.board.mark_dead(side.board.register("kvwire-heartbeat"), "RuntimeError: boom")
        with caplog.at_level("ERROR", logger="kvwire"):
            side._report_dead()
            side._report_dead()
        dead = [r for r in caplog.records if "kvwire-heartbeat is dead" in r.getMessage()]
        assert len(dead) == 1 and "boom" in dead[0].getMessage()
    finally:
        side.close()
