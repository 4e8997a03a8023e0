"""The vLLM plugin and the transfer control plane's bounds and supervision (decision 116): the bounds
come from ``kv_connector_extra_config`` (ControlLimits' field names), each worker's agent runs on the
worker's health board, and a dead component is logged at ``get_finished`` without waiting on it."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from kvwire.connector.config import EngineInfo
from kvwire.errors import ConfigError
from kvwire.integrations.vllm_config import VllmTransferView, plugin_config_from_vllm
from kvwire.integrations.vllm_worker_side import WorkerSide
from kvwire.transfer.agent import NAME
from kvwire.transfer.config import ControlLimits


def view(**extra: Any) -> VllmTransferView:
    return VllmTransferView(kv_role="kv_consumer", kv_connector_extra_config=extra)


def test_limits_default_and_map_from_extra_config() -> None:
    assert plugin_config_from_vllm(view()).transfer.limits == ControlLimits()
    extra = {"max_peer_deadline_s": 60, "max_early_grants_per_peer": "8", "max_pending_per_peer": 16,
             "max_pending_transfers": 500, "max_peers": 9, "max_unexpected_bytes_per_peer": "65536",
             "max_unsolicited_wait_s": "45"}
    cfg = plugin_config_from_vllm(view(**extra))
    assert cfg.transfer.limits == ControlLimits(max_peer_deadline_s=60.0, max_early_grants_per_peer=8,
                                       max_pending_per_peer=16, max_peers=9,
                                       max_unexpected_bytes_per_peer=65536,
                                       max_unsolicited_wait_s=45.0)  # fmt: skip
    agent_config = cfg.transfer.for_rank(1, "cpu")  # what rank 1's worker starts its agent with
    assert agent_config.limits == cfg.transfer.limits and agent_config.max_pending_transfers == 500


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"max_peer_deadline_s": "inf"}, "finite"),
        ({"max_peers": 0}, "max_peers"),
        ({"max_early_grants": "many"}, "integer"),
        ({"max_pending_transfers": 0}, "max_pending_transfers"),
        ({"max_peer_deadlines": 5}, "unknown"),
    ],
)
def test_bad_limits_are_refused_naming_the_key(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plugin_config_from_vllm(view(**extra))


def test_worker_agent_runs_on_the_worker_board_and_a_dead_loop_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker = WorkerSide(plugin_config_from_vllm(view()), EngineInfo(block_size=4))
    try:
        assert worker.agent.board is worker.board  # type: ignore[attr-defined]
        assert [s.name for s in worker.board.snapshot()].count(NAME) == 1  # beside the planes' threads

        def broken(now: float) -> None:
            raise RuntimeError("broken tick")

        monkeypatch.setattr(worker.agent._sender, "renew", broken)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60.0
        while not worker.board.dead():
            assert time.monotonic() < deadline, "the control loop was never given up"
            time.sleep(0.02)
        with caplog.at_level(logging.ERROR, logger="kvwire.integrations.vllm_worker_side"):
            assert worker.get_finished(set()) == (set(), set())  # returns: nothing waits on the dead loop
            worker.get_finished(set())
        mine = [r.getMessage() for r in caplog.records if r.name.endswith("vllm_worker_side")]
        dead_lines = [line for line in mine if "is dead" in line]
        assert len(dead_lines) == 1 and NAME in dead_lines[0]  # logged once
    finally:
        worker.close()
