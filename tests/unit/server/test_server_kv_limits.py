"""``kvwire serve --kv-max-*`` (decision 116): the transfer control plane's bounds, parsed into
ServerConfig.transfer, validated, handed to the transfer agent with the instance's health board, and
exported."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry

from kvwire.engine.config import EngineConfig
from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import Role
from kvwire.server.cli import add_arguments, server_config_from_args
from kvwire.server.config import ServerConfig
from kvwire.server.connectors import build_connector_set
from kvwire.supervision import HealthBoard, SupervisionCollector
from kvwire.transfer.config import ControlLimits, TransferConfig


def _parse(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return server_config_from_args(parser.parse_args(list(argv)))


def test_defaults_are_control_limits_defaults() -> None:
    cfg = _parse()
    assert cfg.transfer.limits == ControlLimits() and cfg.transfer.max_pending_transfers == 65536


def test_kv_limit_flags_reach_the_server_config() -> None:
    cfg = _parse("--kv-max-control-message-bytes", "1048576", "--kv-min-peer-deadline-s", "0.5",
                 "--kv-max-peer-deadline-s", "60", "--kv-max-early-grants", "100",
                 "--kv-max-early-grants-per-peer", "10", "--kv-max-pending-per-peer", "20",
                 "--kv-max-pending-pulls", "30", "--kv-max-pending-transfers", "40",
                 "--kv-max-peers", "50", "--kv-max-unexpected-bytes-per-peer", "4096",
                 "--kv-max-unsolicited-wait-s", "7.5")  # fmt: skip
    assert cfg.transfer.limits == ControlLimits(
        max_message_bytes=1 << 20, min_peer_deadline_s=0.5, max_peer_deadline_s=60.0, max_early_grants=100,
        max_early_grants_per_peer=10, max_pending_per_peer=20, max_pending_pulls=30, max_peers=50,
        max_unexpected_bytes_per_peer=4096, max_unsolicited_wait_s=7.5,
    )  # fmt: skip
    assert cfg.transfer.unexpected_bytes_per_peer == 4096
    assert cfg.transfer.max_pending_transfers == 40


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--kv-max-peer-deadline-s", "inf"], "finite"),
        (["--kv-max-peer-deadline-s", "nan"], "finite"),
        (["--kv-min-peer-deadline-s", "5", "--kv-max-peer-deadline-s", "1"], "min <= max"),
        (["--kv-max-early-grants", "0"], "max_early_grants"),
        (["--kv-max-early-grants", "5", "--kv-max-early-grants-per-peer", "6"], "per_peer"),
        (["--kv-max-control-message-bytes", "100"], "max_message_bytes"),
        (["--kv-max-peers", "0"], "max_peers"),
        (["--kv-max-pending-transfers", "0"], "max_pending_transfers"),
        (["--kv-max-unexpected-bytes-per-peer", "-1"], "max_unexpected_bytes_per_peer"),
        (["--kv-max-unsolicited-wait-s", "0"], "max_unsolicited_wait_s"),
        (["--kv-max-unsolicited-wait-s", "inf"], "max_unsolicited_wait_s"),
    ],
)
def test_bad_kv_limits_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _parse(*argv)


def test_connector_set_hands_the_board_and_limits_to_the_agent() -> None:
    limits = ControlLimits(max_peers=7, max_peer_deadline_s=42.0)
    config = ServerConfig(role=Role.PREFILL, transfer=TransferConfig(limits=limits, max_pending_transfers=99))
    board, registry = HealthBoard(), CollectorRegistry()
    registry.register(SupervisionCollector(board))
    connectors = build_connector_set(config, EngineConfig(model="tiny"), registry, board=board)
    try:
        agent = connectors.worker.agent
        assert agent.board is board
        assert agent.config.limits == limits and agent.config.max_pending_transfers == 99
        assert registry.get_sample_value("kvwire_component_up", {"component": "kvwire-transfer-control"}) == 1
        for limit in ("peer_deadline", "early_grants_per_peer", "pending_per_peer", "peers"):
            assert registry.get_sample_value("kvwire_transfer_limit_hits_total", {"limit": limit}) == 0
    finally:
        connectors.close()
    assert board.snapshot() == []
