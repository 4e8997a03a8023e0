"""``kvwire serve --kv-transport`` and ``--kv-advertise-*``: parsed into ServerConfig.transfer (the agent's
TransferConfig), validated."""

from __future__ import annotations

import argparse

import pytest

from kvwire.errors import ConfigError
from kvwire.server.cli import add_arguments, server_config_from_args
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend, Transport


def test_kv_transport_defaults_to_negotiation_and_can_be_forced() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert server_config_from_args(parser.parse_args([])).transfer.transport is Transport.AUTO
    forced = server_config_from_args(parser.parse_args(["--kv-transport", "tcp"]))
    assert forced.transfer.transport is Transport.TCP
    assert TransferConfig(transport="shm").transport is Transport.SHM  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="transport"):
        TransferConfig(transport="carrier-pigeon")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transport", "rdma"])


def test_kv_advertise_flags_reach_the_transfer_config() -> None:
    """``--kv-advertise-*`` (decision 090): the agent binds ``--host`` and tells peers the given
    host / ports; without them it binds and advertises ``public_host()``."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = server_config_from_args(parser.parse_args([
        "--host", "0.0.0.0", "--kv-port", "7001", "--kv-data-port", "7002", "--kv-advertise-host",
        "kv.example.internal", "--kv-advertise-port", "31001", "--kv-advertise-data-port", "31002"]))
    transfer = cfg.transfer
    assert (transfer.control_port, transfer.data_port) == (7001, 7002)
    assert (transfer.advertise_control_port, transfer.advertise_data_port) == (31001, 31002)
    assert transfer.host == "0.0.0.0" and transfer.advertise_host == "kv.example.internal"
    unadvertised = server_config_from_args(parser.parse_args(["--host", "0.0.0.0"]))
    assert unadvertised.transfer.host == "127.0.0.1"  # nothing advertised: as before
    with pytest.raises(ConfigError, match="kv_advertise_data_port"):
        server_config_from_args(parser.parse_args(["--kv-advertise-data-port", "70000"]))
    with pytest.raises(ConfigError, match="kv_advertise_host"):
        server_config_from_args(parser.parse_args(["--kv-advertise-host", " "]))


def test_the_transfer_config_follows_device_and_secret() -> None:
    """The CLI builds the agent's whole config once: the device picks the backend, the secret (read
    once by the builder) goes in as bytes."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cuda:1", "--kv-deadline-s", "7"])
    cuda = server_config_from_args(args, "k" * 32)
    assert (cuda.transfer.device, cuda.transfer.backend) == ("cuda:1", Backend.NCCL)
    assert cuda.transfer.secret == b"k" * 32 and cuda.transfer.default_deadline_s == 7.0
    assert server_config_from_args(parser.parse_args([])).transfer.backend is Backend.TCP
    with pytest.raises(ConfigError, match="kv_deadline_s"):
        server_config_from_args(parser.parse_args(["--kv-deadline-s", "0"]))
