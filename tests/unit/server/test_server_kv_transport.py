"""``kvwire serve --kv-transport``: parsed into ServerConfig, validated, handed to the transfer agent."""

from __future__ import annotations

import argparse

import pytest

from kvwire.errors import ConfigError
from kvwire.server.cli import add_arguments, server_config_from_args
from kvwire.server.config import ServerConfig
from kvwire.transfer.enums import Transport


def test_kv_transport_defaults_to_negotiation_and_can_be_forced() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert server_config_from_args(parser.parse_args([])).kv_transport is Transport.AUTO
    forced = server_config_from_args(parser.parse_args(["--kv-transport", "tcp"]))
    assert forced.kv_transport is Transport.TCP
    assert ServerConfig(kv_transport="shm").kv_transport is Transport.SHM  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_transport"):
        ServerConfig(kv_transport="carrier-pigeon")  # type: ignore[arg-type]
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
    assert (cfg.kv_port, cfg.kv_data_port, cfg.kv_advertise_port, cfg.kv_advertise_data_port) == (
        7001, 7002, 31001, 31002)
    assert cfg.kv_bind_host() == "0.0.0.0" and cfg.kv_advertise_host == "kv.example.internal"
    assert ServerConfig(host="0.0.0.0").kv_bind_host() == "127.0.0.1"  # nothing advertised: as before
    with pytest.raises(ConfigError, match="kv_advertise_data_port"):
        ServerConfig(kv_advertise_data_port=70000)
    with pytest.raises(ConfigError, match="kv_advertise_host"):
        ServerConfig(kv_advertise_host=" ")
