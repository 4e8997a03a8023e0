"""The plugin's constructor on vLLM's real config objects (no server): a bad key stops the start-up
with kvwire's message; a good config builds the scheduler half."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def vllm_config(model_dir: Path, extra: dict[str, Any], role: str = "kv_consumer") -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    kv = {
        "kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.integrations.vllm",
        "kv_role": role, "kv_connector_extra_config": extra,
    }
    args = EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True,
        kv_transfer_config=KVTransferConfig(**json.loads(json.dumps(kv))),
    )
    return args.create_engine_config()


def test_unknown_key_fails_at_start_up(model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm import KvwireConnector

    config = vllm_config(model_dir, {"proxy_ip": "127.0.0.1", "proxy_port": 1, "kv_ip": "x"})
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config key\(s\) \['kv_ip'\]"):
        KvwireConnector(config, KVConnectorRole.SCHEDULER, None)


def test_seed_keys_accepted_on_real_config(model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector

    seed = {"send_type": "GET", "kv_buffer_size": 1e9, "mem_pool_size_gb": 1, "nccl_num_channels": 8}
    connector = KvwireConnector(vllm_config(model_dir, seed), KVConnectorRole.SCHEDULER, None)
    try:
        assert connector.requires_piecewise_for_cudagraph({}) is True
        assert connector.get_handshake_metadata() is None  # scheduler side: nothing to hand over
    finally:
        connector.shutdown()
