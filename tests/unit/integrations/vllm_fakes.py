"""Stand-ins for the vLLM objects the plugin's halves read (shapes as in vLLM 0.32), and a harness
that drives a scheduler half + worker half like vLLM's engine core and model runner do."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from kvwire.connector.config import EngineInfo
from kvwire.integrations.vllm_config import VllmPluginConfig, VllmTransferView, plugin_config_from_vllm
from kvwire.integrations.vllm_scheduler_side import Identity, RankEndpoint, SchedulerSide
from kvwire.integrations.vllm_worker_side import WorkerSide
from kvwire.transfer.enums import KVLayout

BLOCK = 4
NUM_BLOCKS = 12
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list[str] = dataclasses.field(default_factory=list)
    resumed_req_ids: set[str] = dataclasses.field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = dataclasses.field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = dataclasses.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    finished_req_ids: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)


class BlockPool:
    num_gpu_blocks = NUM_BLOCKS

    def get_num_free_blocks(self) -> int:
        return NUM_BLOCKS - 3


def plugin_config(role: str, **extra: Any) -> VllmPluginConfig:
    return plugin_config_from_vllm(VllmTransferView(kv_role=role, kv_connector_extra_config=extra))


class Instance:
    """One vLLM instance with TP=1: scheduler half, worker half (real transfer agent), KV caches
    ``[num_blocks, heads, block, 2 * head]`` per layer (the CPU backend's per-layer view)."""

    def __init__(self, role: str, fill: Callable[..., torch.Tensor], **extra: Any) -> None:
        self.config = plugin_config(role, **extra)
        self.worker = WorkerSide(self.config, EngineInfo(block_size=BLOCK, kv_layout=KVLayout.MLA))
        self.caches = {name: fill(NUM_BLOCKS, 2, BLOCK, 8) for name in LAYER_NAMES}
        self.worker.register_kv_caches(self.caches)
        self.sched = SchedulerSide(self.config, EngineInfo(block_size=BLOCK), Identity(role, "tiny", "test"))
        self.sched.bind_block_pool(BlockPool())
        self.sched.set_endpoints([RankEndpoint(0, self.worker.endpoint, self.worker.instance_id)])
        self.seen_sending: set[str] = set()
        self.seen_recving: set[str] = set()

    def step(self, output: SchedulerOutput, *, forward: bool = True) -> KVConnectorOutput:
        """schedule -> bind -> (forward: save every layer) -> wait_for_save -> get_finished ->
        update_connector_output, as vLLM does; returns what vLLM's scheduler sees."""
        meta = self.sched.build_connector_meta(output)
        self.worker.bind(meta)
        if forward:
            for name in LAYER_NAMES:
                self.worker.save_kv_layer(name)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(set(output.finished_req_ids))
        out = KVConnectorOutput(sending, recving, self.worker.take_invalid_block_ids())
        self.worker.clear()
        self.sched.update_connector_output(out)
        self.seen_sending |= out.finished_sending or set()
        self.seen_recving |= out.finished_recving or set()
        return out

    def idle_until(self, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not reached")
            self.step(SchedulerOutput(), forward=False)
            time.sleep(0.005)

    def close(self) -> None:
        self.sched.close()
        self.worker.close()
