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
