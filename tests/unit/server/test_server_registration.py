"""Registration with the router goes through one helper (kvwire.discovery.start_registration) for both
hosts: ``kvwire serve`` (server.registration.start_heartbeats) and the vLLM plugin's scheduler half.
Each test receives the real signed heartbeats on a ZeroMQ PULL socket, then the deregistration."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

import kvwire
from kvwire.connector.config import EngineInfo
from kvwire.discovery import Deregister, Heartbeat, InstanceLoad, decode_frames
from kvwire.integrations.vllm_config import VllmTransferView, plugin_config_from_vllm
from kvwire.integrations.vllm_scheduler_side import Identity, RankEndpoint, SchedulerSide
from kvwire.protocol.kv_params import Role
from kvwire.server.config import ServerConfig
from kvwire.server.engine_loop import StatsSnapshot
from kvwire.server.registration import start_heartbeats

SECRET = "s3cret-0123456789abcdef0123456789ab"  # 32+ bytes (decision 124)
RECV_TIMEOUT_MS = 5000


class Router:
    """The router's end of discovery: a PULL socket on a free loopback port."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)  # a missing message fails, never hangs
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def recv(self) -> Heartbeat | Deregister:
        msg = decode_frames(self._sock.recv_multipart(), SECRET.encode())
        assert isinstance(msg, Heartbeat | Deregister)
        return msg

    def heartbeat(self) -> Heartbeat:
        msg = self.recv()
        assert isinstance(msg, Heartbeat), msg
        return msg

    def deregister_after_heartbeats(self) -> Deregister:
        """Skip heartbeats still queued; the deregistration must follow them."""
        for _ in range(100):
            msg = self.recv()
            if isinstance(msg, Deregister):
                return msg
        raise AssertionError("no deregistration after 100 heartbeats")

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def router() -> Iterator[Router]:
    r = Router()
    try:
        yield r
    finally:
        r.close()


def test_server_registers_with_its_identity_and_load(router: Router) -> None:
    config = ServerConfig(role=Role.PREFILL, router_address=router.address, heartbeat_interval_s=0.05)
    stats = StatsSnapshot(num_running=2, num_waiting=1, num_waiting_for_remote_kv=3, kv_blocks_in_use=10,
                          kv_blocks_total=64)
    client = start_heartbeats(config, instance_id="p-1", url="http://127.0.0.1:9000", model="tiny",
                              kv_endpoints=["tcp://127.0.0.1:7000"], stats_fn=lambda: stats, secret=SECRET)
    assert client is not None
    try:
        beat = router.heartbeat()
    finally:
        client.close()
    info = beat.info
    assert (info.instance_id, info.role, info.url, info.model) == (
        "p-1", Role.PREFILL, "http://127.0.0.1:9000", "tiny")
    assert info.kv_endpoints == ["tcp://127.0.0.1:7000"]
    assert info.version == f"kvwire {kvwire.__version__}"
    assert beat.load == InstanceLoad(num_running=2, num_waiting=4, free_kv_blocks=54, total_kv_blocks=64)
    dereg = router.deregister_after_heartbeats()
    assert (dereg.instance_id, dereg.epoch) == ("p-1", info.epoch)


def test_server_without_router_does_not_register() -> None:
    assert start_heartbeats(ServerConfig(), instance_id="x", url="http://h:1", model="m", kv_endpoints=[],
                            stats_fn=StatsSnapshot) is None


def test_vllm_scheduler_side_registers_like_the_server(router: Router) -> None:
    extra = {"router": router.address, "http_host": "10.1.1.1", "http_port": 8000, "secret": SECRET,
             "heartbeat_interval_s": 0.05}
    config = plugin_config_from_vllm(VllmTransferView(kv_role="kv_consumer", kv_connector_extra_config=extra))
    side = SchedulerSide(config, EngineInfo(block_size=4), Identity("d-7", "tiny", "vllm 0.32"))
    try:
        side.set_endpoints([RankEndpoint(1, "tcp://127.0.0.1:7101", "agent-b"),
                            RankEndpoint(0, "tcp://127.0.0.1:7100", "agent-a")])
        beat = router.heartbeat()
    finally:
        side.close()
    info = beat.info
    assert (info.instance_id, info.role, info.url, info.model, info.version) == (
        "d-7", Role.DECODE, "http://10.1.1.1:8000", "tiny", "vllm 0.32")
    assert info.kv_endpoints == ["tcp://127.0.0.1:7100", "tcp://127.0.0.1:7101"]  # in rank order
    assert beat.load == InstanceLoad()  # no scheduler step yet
    assert router.deregister_after_heartbeats().instance_id == "d-7"


def test_unknown_role_is_a_config_error_and_starts_nothing() -> None:
    from kvwire.discovery import start_registration
    from kvwire.errors import ConfigError

    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="role must be one of"):
        start_registration("tcp://127.0.0.1:1", instance_id="x", role="router", url="http://h:1",
                           model="m", kv_endpoints=[], version="v", load_fn=None, interval_s=1.0)
    assert {t.name for t in threading.enumerate()} == threads  # no heartbeat thread
