"""Replayed heartbeats (decision 124): with a secret, a correctly signed heartbeat captured earlier is
refused — by its signed ``sent_at`` once older than MAX_SIGNED_AGE_S, and by the registry's per-epoch
``seq`` while the instance is registered. A real ZeroMQ listener on loopback."""

from __future__ import annotations

import time

import zmq

from kvwire.discovery import Heartbeat, InstanceInfo
from kvwire.discovery.messages import MAX_SIGNED_AGE_S, encode_frames
from kvwire.kv_params import Role
from kvwire.router.listener import DiscoveryListener
from kvwire.router.registry import Registry
from support.waiting import wait_for

SECRET = b"replay-test-secret-0123456789abcdef"


def test_replayed_signed_heartbeats_are_refused() -> None:
    registry = Registry(ttl_s=30.0)
    listener = DiscoveryListener(registry, "127.0.0.1", 0, secret=SECRET).start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(listener.address)
    info = InstanceInfo(instance_id="victim", role=Role.DECODE, url="http://127.0.0.1:1", model="m")
    try:
        old = Heartbeat(info=info, seq=1, sent_at=time.time() - MAX_SIGNED_AGE_S - 60)
        push.send_multipart(encode_frames(old, SECRET))  # captured a while ago, replayed now
        wait_for(lambda: listener.dropped["stale_signed"] == 1, 20, "the old capture refused")
        assert registry.get("victim") is None
        future = Heartbeat(info=info, seq=1, sent_at=time.time() + MAX_SIGNED_AGE_S + 60)
        push.send_multipart(encode_frames(future, SECRET))
        wait_for(lambda: listener.dropped["stale_signed"] == 2, 20, "a far-future one refused")
        fresh = encode_frames(Heartbeat(info=info, seq=5, sent_at=time.time()), SECRET)
        push.send_multipart(fresh)
        wait_for(lambda: registry.get("victim") is not None, 20, "a fresh heartbeat registers")
        push.send_multipart(fresh)  # replayed within the window: the registry's seq check
        wait_for(lambda: listener.received["stale"] == 1, 20, "the replay ignored as stale")
        assert registry.get("victim").last_seq == 5  # type: ignore[union-attr]
    finally:
        push.close()
        ctx.term()
        listener.close()
