"""The etcd router's expiry without an etcd: the deadline heap, the typed watch stream, and the
probe that confirms a silence (its transaction answered by a stub)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from kvwire.discovery import InstanceInfo, parse_discovery_address
from kvwire.discovery.etcd_gateway import EtcdError, encode_record
from kvwire.discovery.heartbeats import Heartbeat
from kvwire.protocol.kv_params import Role
from kvwire.router.etcd_expiry import DeadlineHeap
from kvwire.router.etcd_stream import WatchEvent, WatchKv, decode_watch_message
from kvwire.router.etcd_watcher import EtcdWatcher
from kvwire.router.registry import InstanceState, Registry


def test_deadline_heap_keeps_only_each_instances_latest_deadline() -> None:
    heap = DeadlineHeap()
    heap.set("a", 3.0)
    heap.set("b", 2.0)
    heap.set("a", 5.0)  # a's next record: its first deadline no longer counts
    heap.set("c", 1.0)
    heap.discard("c")  # deleted
    assert heap.earliest() == 2.0 and len(heap) == 2 and "a" in heap and "c" not in heap
    assert heap.pop_before(9.0, limit=1) == ["b"] and heap.earliest() == 5.0  # the rest stay
    assert heap.pop_before(4.0) == [] and heap.earliest() == 5.0
    assert heap.pop_before(5.5) == ["a"] and heap.earliest() is None


def test_watch_messages_decode_to_structs() -> None:
    line = json.dumps({"result": {"header": {"revision": "9"}, "events": [
        {"kv": {"key": base64.b64encode(b"/p/a").decode(), "value": base64.b64encode(b"{}").decode(),
                "mod_revision": "7"}},
        {"type": "DELETE", "kv": {"key": base64.b64encode(b"/p/b").decode(), "mod_revision": "8"}},
    ]}}).encode()
    message = decode_watch_message(line)
    assert message.result is not None
    assert [(e.type, e.kv.key, e.kv.mod_revision) for e in message.result.events if e.kv] == [
        ("PUT", b"/p/a", 7), ("DELETE", b"/p/b", 8)]
    assert decode_watch_message(b'{"error": {"message": "boom"}}').error == {"message": "boom"}
    with pytest.raises(EtcdError, match="not a watch message"):
        decode_watch_message(b'{"result": {"events": [{"kv": {"mod_revision": "x"}}]}}')


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _record(ident: str, seq: int) -> Heartbeat:
    url = f"http://127.0.0.1:{9000 + ord(ident)}"
    info = InstanceInfo(instance_id=ident, role=Role.DECODE, url=url, model="m", epoch=1)
    return Heartbeat(info=info, seq=seq, ttl_s=2.0)


def test_a_probe_expires_only_what_etcd_confirms_silent() -> None:
    """Past their deadline, a (still at the revision the router saw) and c (key gone) are expired
    as of the probe; b (etcd holds a newer record the watch has not delivered) stays and is asked
    about again; nobody is expired while etcd does not answer."""
    target = parse_discovery_address("etcd://127.0.0.1:1/p")
    clock = Clock()
    registry = Registry(ttl_s=100.0, clock=clock)
    watcher = EtcdWatcher(registry, target)
    watcher.stale = False
    events = [WatchEvent(kv=WatchKv(key=f"/p/{i}".encode(), value=encode_record(_record(i, 1)),
                                    mod_revision=rev)) for rev, i in enumerate("abc", start=10)]
    watcher.records.apply_events(events)
    assert watcher.revision == 12 and len(registry.live(Role.DECODE)) == 3
    etcd_revisions = {"a": 10, "b": 15, "c": None}  # b: a newer record on its way; c: lease gone
    answers: list[dict[str, Any] | Exception] = [EtcdError("unreachable")]

    async def post(path: str, body: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
        assert path == "/v3/kv/txn"
        answer = answers.pop(0) if answers else None
        if isinstance(answer, Exception):
            raise answer
        keys = [base64.b64decode(op["request_range"]["key"]).decode() for op in body["success"]]
        assert all(op["request_range"]["serializable"] for op in body["success"])
        responses = []
        for key in keys:
            rev = etcd_revisions[key.removeprefix("/p/")]
            kvs = [] if rev is None else [{"key": "", "mod_revision": str(rev)}]
            responses.append({"response_range": {"kvs": kvs} if kvs else {}})
        return {"responses": responses}

    watcher.client.post = post  # type: ignore[method-assign]

    async def scenario() -> None:
        clock.now += 1.0
        assert watcher.expiry.step() > 0 and not watcher.expiry.in_flight  # nothing due yet
        clock.now += 1.5  # everyone 2.5 s silent, TTL 2 s
        watcher.expiry.step()
        await asyncio.gather(*watcher.expiry.in_flight)  # etcd did not answer: nobody expired
        assert watcher.probes["failed"] == 3 and len(registry.live(Role.DECODE)) == 3
        clock.now += 0.3  # the failed ones are asked again
        watcher.expiry.step()
        await asyncio.gather(*watcher.expiry.in_flight)
        assert {v.instance_id for v in registry.live(Role.DECODE)} == {"b"}
        assert registry.get("a").state is InstanceState.EXPIRED  # type: ignore[union-attr]
        assert watcher.probes["expired"] == 2 and watcher.probes["behind"] == 1
        assert "b" in watcher.records.deadlines  # asked again unless its newer record arrives first
        watcher.records.apply_events([WatchEvent(kv=WatchKv(key=b"/p/b", value=encode_record(_record("b", 2)),
                                                     mod_revision=15))])
        assert watcher.records.deadlines.earliest() == pytest.approx(clock.now + 2.0)

    asyncio.run(scenario())
