"""Discovery addresses, etcd records and the router's --discovery option (no etcd needed)."""

from __future__ import annotations

import pytest

from kvwire.discovery import Heartbeat, InstanceInfo, InstanceLoad
from kvwire.discovery.address import DEFAULT_ETCD_PREFIX, DiscoveryKind, parse_discovery_address
from kvwire.discovery.etcd_client import lease_ttl_for
from kvwire.discovery.etcd_gateway import decode_record, encode_record, prefix_range_end
from kvwire.errors import ConfigError, ProtocolError
from kvwire.protocol.kv_params import Role
from kvwire.router.config import RouterConfig


def test_zmq_address_passes_through() -> None:
    target = parse_discovery_address("tcp://10.0.0.1:8001")
    assert target.kind is DiscoveryKind.ZMQ and target.address == "tcp://10.0.0.1:8001"


@pytest.mark.parametrize(
    ("text", "url", "prefix"),
    [
        ("etcd://127.0.0.1:2379", "http://127.0.0.1:2379", DEFAULT_ETCD_PREFIX),
        ("etcd://etcd.svc:2379/", "http://etcd.svc:2379", DEFAULT_ETCD_PREFIX),
        ("etcd://h:1/team-a", "http://h:1", "/team-a/"),
        ("etcd://h:1/a/b/", "http://h:1", "/a/b/"),
        ("etcd://[::1]:2379", "http://[::1]:2379", DEFAULT_ETCD_PREFIX),
    ],
)
def test_etcd_address(text: str, url: str, prefix: str) -> None:
    target = parse_discovery_address(text)
    assert (target.kind, target.address, target.prefix) == (DiscoveryKind.ETCD, url, prefix)
    assert target.key("p0") == prefix + "p0"
    assert parse_discovery_address(str(target)) == target


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1:2379", "tcp://HOST:PORT"),
        ("http://h:2379", "tcp://HOST:PORT"),
        ("etcd://h", "etcd://HOST:PORT"),
        ("etcd://:2379", "etcd://HOST:PORT"),
        ("etcd://h:notaport", "bad port"),
        ("etcd://h:1/p?x=1", "unknown etcd option"),
        ("etcd://h:1/p#x", "no fragment"),
    ],
)
def test_bad_address_fails_clearly(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_discovery_address(text)


def test_router_discovery_option() -> None:
    assert RouterConfig().discovery_target is None
    assert RouterConfig(discovery="zmq").discovery_target is None
    target = RouterConfig(discovery="etcd://h:2379/x").discovery_target
    assert target is not None and target.prefix == "/x/"
    with pytest.raises(ConfigError, match="--discovery-host"):
        RouterConfig(discovery="tcp://h:1")


def test_prefix_range_end_covers_exactly_the_prefix() -> None:
    end = prefix_range_end("/kvwire/instances/")
    assert end == "/kvwire/instances0"
    assert "/kvwire/instances/" <= "/kvwire/instances/zzz" < end
    assert end <= "/kvwire/instancesX"


def test_record_round_trip_and_validation() -> None:
    info = InstanceInfo(instance_id="d0", role=Role.DECODE, url="http://h:1", model="m",
                        kv_endpoints=["tcp://h:2", "tcp://h:3"])
    hb = Heartbeat(info=info, load=InstanceLoad(num_running=3), seq=7, sent_at=1.0)
    assert decode_record(encode_record(hb)) == hb
    with pytest.raises(ProtocolError, match="malformed"):
        decode_record(b"{not json")
    with pytest.raises(ProtocolError, match="empty model"):
        decode_record(encode_record(Heartbeat(info=InstanceInfo(instance_id="x", role=Role.BOTH,
                                                                 url="http://h:1", model=""))))
    with pytest.raises(ProtocolError, match="version"):
        decode_record(encode_record(Heartbeat(info=info, v=99)))


@pytest.mark.parametrize(("interval_s", "ttl"), [(2.0, 6), (1.0, 3), (0.5, 2), (0.1, 2), (1.5, 5)])
def test_lease_ttl_is_three_intervals(interval_s: float, ttl: int) -> None:
    assert lease_ttl_for(interval_s) == ttl


def test_cluster_discovery_choice() -> None:
    from kvwire.cluster.local import ClusterSpec

    assert ClusterSpec(discovery="etcd").discovery == "etcd"
    assert ClusterSpec(discovery="etcd://h:2379").discovery == "etcd://h:2379"
    assert ClusterSpec(discovery="etcd+https://h:2379").discovery == "etcd+https://h:2379"
    for bad in ("tcp://h:1", "consul"):
        with pytest.raises(ConfigError, match="etcd"):
            ClusterSpec(discovery=bad)


def test_least_loaded_samples_large_pools() -> None:
    """Over SAMPLE_SIZE live instances, least_loaded looks at a random sample: every pick is one of
    the live instances, picks spread, and an idle instance among busy ones is found often."""
    from kvwire.router.config import Policy
    from kvwire.router.registry import Registry
    from kvwire.router.selection import SAMPLE_SIZE, Selector

    reg = Registry(ttl_s=10.0)
    n = 4 * SAMPLE_SIZE
    for i in range(n):
        info = InstanceInfo(instance_id=f"d{i:03d}", role=Role.DECODE, url=f"http://h/{i}", model="m")
        busy = 0 if i % 8 == 0 else 5  # one in eight idle
        reg.apply(Heartbeat(info=info, seq=1, load=InstanceLoad(num_running=busy)))
    selector = Selector(reg, Policy.LEAST_LOADED, seed=3)
    picks = [selector.pick(Role.DECODE, "m").instance_id for _ in range(200)]
    idle = sum(int(p[1:]) % 8 == 0 for p in picks)
    assert idle >= 190  # a sample of 32 misses all 16 idle ones with p ~ 0.015
    assert len(set(picks)) > 8


def test_watch_stream_lines_survive_any_chunking() -> None:
    import asyncio
    import base64

    from kvwire.router.etcd_stream import watch_messages

    sizes = (1, 70_000, 5)
    messages = [{"result": {"events": [{"kv": {"key": base64.b64encode(b"a" * n).decode()}}]}} for n in sizes]
    raw = b"\n".join(msgspec_json(m) for m in messages) + b"\n"

    class Stream:
        def __init__(self, size: int) -> None:
            self.size = size

        async def iter_any(self):  # type: ignore[no-untyped-def]
            for i in range(0, len(raw), self.size):
                yield raw[i:i + self.size]

    async def collect(size: int) -> list[bytes]:
        return [m.result.events[0].kv.key  # type: ignore[union-attr]
                async for m in watch_messages(Stream(size))]  # type: ignore[arg-type]

    for size in (1, 7, 4096, len(raw)):
        assert asyncio.run(collect(size)) == [b"a" * n for n in sizes]


def msgspec_json(obj: object) -> bytes:
    import msgspec

    return msgspec.json.encode(obj)


def test_watch_backlog_does_not_starve_the_event_loop() -> None:
    """A watch stream with a backlog (aiohttp returns buffered data without suspending) must still
    let the router's other tasks run between messages."""
    import asyncio
    import base64
    import json

    from kvwire.router.etcd_watcher import EtcdWatcher
    from kvwire.router.registry import Registry

    def put(i: int) -> bytes:
        info = InstanceInfo(instance_id=f"i{i}", role=Role.DECODE, url=f"http://h/{i}", model="m")
        value = base64.b64encode(encode_record(Heartbeat(info=info, seq=1))).decode()
        return json.dumps({"result": {"events": [{"type": "PUT", "kv": {"value": value}}]}}).encode()

    backlog = b"\n".join(put(i) for i in range(500)) + b"\n"

    class Response:
        status = 200

        class content:  # aiohttp's attribute name
            @staticmethod
            async def iter_any():  # type: ignore[no-untyped-def]
                for k in range(0, len(backlog), 4096):
                    yield backlog[k:k + 4096]  # all buffered: never suspends

        async def __aenter__(self) -> Response:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    class Session:
        def post(self, url: str, json: object, headers: object = None) -> Response:
            return Response()

    async def scenario() -> tuple[int, int]:
        registry = Registry(ttl_s=10.0)
        watcher = EtcdWatcher(registry, parse_discovery_address("etcd://h:1"))
        watcher.client.session = Session()  # type: ignore[assignment]
        ticks = 0

        async def other_work() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_work())
        await asyncio.sleep(0)
        await watcher._watch(1)
        task.cancel()
        return ticks, len(registry.snapshot())

    ticks, registered = asyncio.run(scenario())
    assert registered == 500
    assert ticks >= 400  # the other task ran between (nearly) every message
