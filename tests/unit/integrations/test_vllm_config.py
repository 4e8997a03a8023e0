"""kv_transfer_config -> kvwire config mapping (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvwire.connector.config import LoadFailurePolicy
from kvwire.errors import ConfigError
from kvwire.integrations.vllm_config import (
    VLLM_DEFAULT_KV_PORT,
    GiB,
    VllmTransferView,
    plugin_config_from_vllm,
)
from kvwire.protocol.kv_params import Role, TransferMode
from kvwire.transfer.enums import Backend, Transport

SECRET = "s3cret-0123456789abcdef0123456789ab"  # 32+ bytes (decision 124)


def view(role: str = "kv_producer", **extra: Any) -> VllmTransferView:
    return VllmTransferView(kv_role=role, kv_connector_extra_config=extra)


def test_defaults() -> None:
    cfg = plugin_config_from_vllm(view())
    assert cfg.connector.role is Role.PREFILL
    assert cfg.connector.mode is TransferMode.PUSH
    assert cfg.connector.use_first_token is False
    transfer = cfg.transfer
    assert transfer.backend is Backend.TCP and transfer.transport is Transport.AUTO  # shm on one host
    assert plugin_config_from_vllm(view(transport="TCP")).transfer.transport is Transport.TCP
    assert transfer.control_port == 0 and transfer.for_rank(3, "cpu").control_port == 0
    assert cfg.router_address is None and cfg.http_url is None
    assert transfer.recv_budget_bytes == GiB and transfer.spill_budget_bytes == GiB
    assert transfer.default_deadline_s == cfg.connector.agent_deadline_s and cfg.device_type == "cpu"


@pytest.mark.parametrize(
    ("role", "expected"),
    [
        ("kv_producer", Role.PREFILL),
        ("kv_consumer", Role.DECODE),
        ("kv_both", Role.BOTH),
    ],
)
def test_roles(role: str, expected: Role) -> None:
    assert plugin_config_from_vllm(view(role)).connector.role is expected


def test_missing_role_fails() -> None:
    with pytest.raises(ConfigError, match="kv_role"):
        plugin_config_from_vllm(VllmTransferView(kv_role=None))


def test_seed_keys_map() -> None:
    cfg = plugin_config_from_vllm(
        VllmTransferView(
            kv_role="kv_consumer",
            kv_port=21001,
            kv_buffer_device="cuda",
            kv_connector_extra_config={
                "proxy_ip": "10.0.0.1",
                "proxy_port": "30001",
                "http_port": 20001,
                "send_type": "PUT_ASYNC",
                "nccl_num_channels": "16",
                "mem_pool_size_gb": 32,
                "kv_buffer_size": 1e9,
            },
        )
    )
    assert cfg.router_address == "tcp://10.0.0.1:30001"
    assert cfg.http_url == "http://127.0.0.1:20001"
    assert cfg.connector.mode is TransferMode.PUSH
    assert cfg.transfer.backend is Backend.NCCL and cfg.nccl_num_channels == 16
    assert cfg.transfer.spill_budget_bytes == 32 * GiB
    assert cfg.transfer.recv_budget_bytes == 1_000_000_000
    assert cfg.transfer.control_port == 21001 and cfg.transfer.for_rank(2, "cuda:2").control_port == 21003


def test_discovery_etcd() -> None:
    cfg = plugin_config_from_vllm(view(discovery="etcd://10.0.0.9:2379/team-a", http_port=8100))
    assert cfg.router_address == "etcd://10.0.0.9:2379/team-a"


def test_discovery_etcd_with_credentials(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("pw\n")
    address = f"etcd://kv@10.0.0.9:2379/team-a?password_file={secret}"
    assert plugin_config_from_vllm(view(discovery=address, http_port=8100)).router_address == address


@pytest.mark.parametrize(("send_type", "mode"), [("PUT", TransferMode.PUSH), ("get", TransferMode.PULL)])
def test_send_type(send_type: str, mode: TransferMode) -> None:
    assert plugin_config_from_vllm(view(send_type=send_type)).connector.mode is mode


def test_kvwire_keys() -> None:
    cfg = plugin_config_from_vllm(
        view(
            "kv_both", router="tcp://127.0.0.1:5555", http_host="10.1.1.1", http_port=8000, mode="pull",
            deadline_s=5, lease_s=7.5, secret=SECRET, heartbeat_interval_s=0.5, instance_id="p0",
            model_name="tiny", host="0.0.0.0", backend="tcp",
        )
    )
    assert cfg.router_address == "tcp://127.0.0.1:5555"
    assert cfg.http_url == "http://10.1.1.1:8000"
    assert cfg.connector.mode is TransferMode.PULL
    assert cfg.connector.deadline_s == 5 and cfg.connector.lease_s == 7.5
    assert (cfg.secret, cfg.heartbeat_interval_s, cfg.instance_id, cfg.model_name, cfg.transfer.host) == (
        SECRET, 0.5, "p0", "tiny", "0.0.0.0",
    )
    assert cfg.transfer.secret == SECRET.encode()


def test_secret_from_a_file_or_the_environment_and_at_least_32_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert plugin_config_from_vllm(view("kv_producer", secret_file=str(path))).secret == SECRET
    monkeypatch.setenv("KVWIRE_SECRET", "e" * 32)
    assert plugin_config_from_vllm(view("kv_producer")).secret == "e" * 32
    with pytest.raises(ConfigError, match="at least 32"):
        plugin_config_from_vllm(view("kv_producer", secret="short"))
    with pytest.raises(ConfigError, match="not both"):
        plugin_config_from_vllm(view("kv_producer", secret=SECRET, secret_file=str(path)))


def test_default_kv_port_means_any_free_port() -> None:
    cfg = plugin_config_from_vllm(VllmTransferView(kv_role="kv_producer", kv_port=VLLM_DEFAULT_KV_PORT))
    assert cfg.transfer.control_port == 0


def test_failure_policy_follows_vllm() -> None:
    # The core always reports failed loads as invalid blocks; vLLM's policy decides what happens.
    for policy in ("recompute", "fail"):
        cfg = plugin_config_from_vllm(VllmTransferView(kv_role="kv_consumer", kv_load_failure_policy=policy))
        assert cfg.connector.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE
        assert cfg.vllm_failure_policy is LoadFailurePolicy(policy)
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        plugin_config_from_vllm(VllmTransferView(kv_role="kv_consumer", kv_load_failure_policy="retry"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"bogus": 1}, r"unknown kv_connector_extra_config key\(s\) \['bogus'\]"),
        ({"send_type": "PUSH"}, "send_type must be one of"),
        ({"send_type": "GET", "mode": "push"}, "contradicts"),
        ({"proxy_ip": "1.2.3.4"}, "proxy_ip and proxy_port go together"),
        (
            {"proxy_ip": "1.2.3.4", "proxy_port": 1, "router": "tcp://5.6.7.8:1", "http_port": 1},
            "contradicts",
        ),
        ({"router": "tcp://127.0.0.1:1"}, "http_port"),
        ({"router": "127.0.0.1:1", "http_port": 1}, "tcp://HOST:PORT"),
        ({"discovery": "etcd://h:2379", "router": "tcp://h:1", "http_port": 1}, "alternatives"),
        ({"discovery": "etcd://h", "http_port": 1}, r"etcd://HOST:PORT\[/prefix\]"),
        ({"http_port": "eighty"}, "must be an integer"),
        ({"http_port": True}, "must be an integer"),
        ({"kv_buffer_size": 1, "recv_budget_bytes": 2}, "both"),
        ({"mem_pool_size_gb": -1}, "spill_budget_bytes must be >= 0"),
        ({"kv_buffer_size": 0}, "must be > 0"),
        ({"backend": "nccl"}, "needs kv_buffer_device 'cuda'"),
        ({"backend": "rdma"}, "backend must be"),
        ({"transport": "carrier-pigeon"}, "transport must be one of auto"),
        ({"transport": "ipc"}, "needs kv_buffer_device 'cuda'"),
        ({"nccl_num_channels": 0, "backend": "tcp"}, "nccl_num_channels must be > 0"),
        ({"deadline_s": 0}, "deadline_s must be > 0"),
        ({"mode": ""}, "non-empty string"),
    ],
)
def test_bad_config_fails_clearly(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plugin_config_from_vllm(view(**extra))


def test_from_vllm_duck_typed() -> None:
    class FakeKVTransferConfig:
        kv_role = "kv_consumer"
        kv_port = 14579
        kv_buffer_device = "cpu"
        kv_load_failure_policy = "fail"
        engine_id = "engine-1"
        kv_connector_extra_config = {"send_type": "GET"}

    cfg = plugin_config_from_vllm(VllmTransferView.from_vllm(FakeKVTransferConfig()))
    assert cfg.instance_id == "engine-1"
    assert cfg.connector.mode is TransferMode.PULL
    assert cfg.vllm_failure_policy is LoadFailurePolicy.FAIL


def test_several_routers() -> None:
    extra = {"router": ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"], "http_port": 20001}
    cfg = plugin_config_from_vllm(VllmTransferView(kv_role="kv_producer", kv_connector_extra_config=extra))
    assert cfg.router_address == "tcp://10.0.0.1:1,tcp://10.0.0.2:1"
    with pytest.raises(ConfigError, match="router"):
        plugin_config_from_vllm(VllmTransferView(
            kv_role="kv_producer", kv_connector_extra_config={"router": ["http://x"], "http_port": 1}))


def test_advertise_keys_give_each_rank_its_ports() -> None:
    """``advertise_host`` / ``advertise_port`` / ``data_port`` / ``advertise_data_port`` (decision
    090): rank r binds and advertises base + r."""
    extra = {"host": "0.0.0.0", "advertise_host": "kv.example.internal", "data_port": 7100,
             "advertise_port": "31000", "advertise_data_port": 31100}
    cfg = plugin_config_from_vllm(VllmTransferView(kv_role="kv_producer", kv_port=7000,
                                                   kv_connector_extra_config=extra))
    assert cfg.transfer.advertise_host == "kv.example.internal" and cfg.transfer.host == "0.0.0.0"
    rank1 = cfg.transfer.for_rank(1, "cpu")
    assert (rank1.control_port, rank1.data_port, rank1.advertise_control_port, rank1.advertise_data_port) == (
        7001, 7101, 31001, 31101)
    rank0 = plugin_config_from_vllm(view("kv_producer")).transfer.for_rank(0, "cpu")
    assert (rank0.control_port, rank0.data_port, rank0.advertise_control_port, rank0.advertise_data_port) == (
        0, 0, 0, 0)
    with pytest.raises(ConfigError, match="advertise_port"):
        plugin_config_from_vllm(VllmTransferView(kv_role="kv_producer",
                                                 kv_connector_extra_config={"advertise_port": 70000}))


def test_fault_delay_send_is_parsed_and_validated() -> None:
    extra = {"fault_delay_send": {"seconds": 8, "transfer_id_prefix": "slow-"}}
    fault = plugin_config_from_vllm(VllmTransferView(kv_role="kv_producer",
                                                     kv_connector_extra_config=extra)).fault_delay_send
    assert fault is not None and fault.seconds == 8.0
    assert fault.applies(["x", "slow-1"]) and not fault.applies(["fast-1"])
    assert plugin_config_from_vllm(view("kv_producer")).fault_delay_send is None
    for bad in ({"seconds": 0}, {"seconds": 1, "other": 2}, {"transfer_id_prefix": "x"}, 5):
        with pytest.raises(ConfigError, match=r"fault_delay_send|seconds"):
            plugin_config_from_vllm(VllmTransferView(kv_role="kv_producer",
                                                     kv_connector_extra_config={"fault_delay_send": bad}))
