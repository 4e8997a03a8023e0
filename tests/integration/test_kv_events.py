"""KV events end to end over the real discovery connection: an instance's heartbeat client publishes
its event log in batches; the router's listener fills the KV index; deregistration empties it."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvwire.discovery import HeartbeatClient, InstanceInfo
from kvwire.protocol.kv_blocks import KvEventLog
from kvwire.protocol.kv_params import Role
from kvwire.router.listener import DiscoveryListener
from kvwire.router.registry import KvIndex, Registry


def poll(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_events_reach_the_index_and_leave_with_the_instance() -> None:
    index = KvIndex()
    registry = Registry(ttl_s=30.0, on_remove=index.drop)
    listener = DiscoveryListener(registry, "127.0.0.1", 0, secret=b"s", kv_index=index).start()
    log = KvEventLog(16)
    info = InstanceInfo(instance_id="d0", role=Role.DECODE, url="http://127.0.0.1:1", model="m")
    client = HeartbeatClient(listener.address, info, interval_s=10.0, secret="s", kv_events=log,
                             kv_events_interval_s=0.01).start()
    try:
        assert poll(lambda: registry.get("d0") is not None)
        log.stored(range(1, 9001))  # more than one batch: sent over a few ticks
        assert poll(lambda: index.num_blocks("d0") == 9000)
        assert index.block_size("d0") == 16
        log.removed(range(1, 101))
        assert poll(lambda: index.num_blocks("d0") == 8900)
        assert listener.received["kv_events"] >= 3
    finally:
        client.close()
        assert poll(lambda: registry.get("d0") is None)
        assert index.num_blocks("d0") == 0
        listener.close()


def test_a_burst_of_heartbeats_lands_in_batches_in_arrival_order() -> None:
    """The listener applies what queued up in batches (one registry update each): every instance of a
    burst registers, counted once, and a later (stale-seq) heartbeat of one instance never undoes an
    earlier one in the same burst."""
    import zmq

    from kvwire.discovery.heartbeats import Heartbeat, InstanceLoad, encode_frames

    registry = Registry(ttl_s=30.0)
    listener = DiscoveryListener(registry, "127.0.0.1", 0)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(listener.address)
    infos = [
        InstanceInfo(instance_id=f"p{i}", role=Role.PREFILL, url=f"http://127.0.0.1:{i + 1}", model="m")
        for i in range(150)
    ]
    try:
        for seq in (2, 1):  # seq 2 first, then a stale seq 1 of each: the registry keeps seq 2's load
            for info in infos:
                hb = Heartbeat(info=info, load=InstanceLoad(num_running=seq), seq=seq, sent_at=time.time())
                push.send_multipart(encode_frames(hb))
        listener.start()  # everything is queued before the thread's first drain
        assert poll(lambda: sum(listener.received.values()) == 300)
        assert listener.received["registered"] == 150 and listener.received["stale"] == 150
        assert len(registry.live(Role.PREFILL)) == 150
        assert all(v.load.num_running == 2 for v in registry.live(Role.PREFILL))
    finally:
        push.close()
        ctx.term()


def test_a_restarted_router_gets_a_full_snapshot() -> None:
    """The router's index lives in memory: a router started after the instance (or restarted at the
    same address) learns every cached block from the snapshot the new connection triggers."""
    index = KvIndex()
    registry = Registry(ttl_s=30.0, on_remove=index.drop)
    listener = DiscoveryListener(registry, "127.0.0.1", 0, kv_index=index).start()
    port = listener.port
    log = KvEventLog(16)
    info = InstanceInfo(instance_id="d0", role=Role.DECODE, url="http://127.0.0.1:1", model="m")
    client = HeartbeatClient(listener.address, info, interval_s=10.0, kv_events=log,
                             kv_events_interval_s=0.01).start()
    restarted = None
    try:
        log.stored(range(1, 5001))
        assert poll(lambda: index.num_blocks("d0") == 5000)
        listener.close()  # the router goes away with its index
        log.removed(range(1, 11))  # changes while no router listens
        index2 = KvIndex()
        registry2 = Registry(ttl_s=30.0, on_remove=index2.drop)
        restarted = DiscoveryListener(registry2, "127.0.0.1", port, kv_index=index2).start()
        # registered at once (not after the 10 s heartbeat interval), the whole cache re-sent
        assert poll(lambda: registry2.get("d0") is not None and index2.num_blocks("d0") == 4990)
        assert index2.match(["d0"], lambda _bs: list(range(11, 21))) == {"d0": 10}
        assert client.connections >= 2
    finally:
        client.close()
        if restarted is not None:
            restarted.close()
        listener.close()
