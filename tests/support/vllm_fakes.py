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
    """One vLLM instance: scheduler half, ``tp`` worker halves (TP ranks, real transfer agents), KV
    caches ``[num_blocks, heads, block, 2 * head]`` per layer and rank (the CPU backend's view).
    ``num_kv_heads`` None: the model's heads are not told (the layers are then opaque, MLA). Each
    rank's finished ids are merged as vLLM's KVOutputAggregator does (reported once every rank did)."""

    def __init__(self, role: str, fill: Callable[..., torch.Tensor], *, tp: int = 1,
                 num_kv_heads: int | None = None, **extra: Any) -> None:  # fmt: skip
        self.config = plugin_config(role, **extra)
        heads = num_kv_heads or 2
        self.workers = [
            WorkerSide(self.config, EngineInfo(block_size=BLOCK, kv_layout=KVLayout.MLA, rank=r, tp_size=tp,
                                               num_kv_heads=num_kv_heads))
            for r in range(tp)
        ]  # fmt: skip
        self.worker = self.workers[0]
        local = max(1, heads // tp)
        self.rank_caches = [
            {name: fill(NUM_BLOCKS, local, BLOCK, 8) for name in LAYER_NAMES} for _ in range(tp)
        ]
        self.caches = self.rank_caches[0]
        for worker, caches in zip(self.workers, self.rank_caches, strict=True):
            worker.register_kv_caches(caches)
        self.sched = SchedulerSide(self.config, EngineInfo(block_size=BLOCK), Identity(role, "tiny", "test"))
        self.sched.bind_block_pool(BlockPool())
        self.sched.set_endpoints(
            [RankEndpoint(r, w.endpoint, w.instance_id) for r, w in enumerate(self.workers)]
        )
        self.seen_sending: set[str] = set()
        self.seen_recving: set[str] = set()
        self._counts: dict[tuple[str, str], int] = {}

    @property
    def endpoints(self) -> list[str]:
        return [w.endpoint for w in self.workers]

    def _all_ranks(self, kind: str, ids: set[str]) -> set[str]:
        done = set()
        for rid in ids:
            n = self._counts[(kind, rid)] = self._counts.get((kind, rid), 0) + 1
            if n == len(self.workers):
                del self._counts[(kind, rid)]
                done.add(rid)
        return done

    def step(self, output: SchedulerOutput, *, forward: bool = True) -> KVConnectorOutput:
        """schedule -> bind -> (forward: save every layer) -> wait_for_save -> get_finished ->
        update_connector_output on every rank, as vLLM does; returns what vLLM's scheduler sees."""
        meta = self.sched.build_connector_meta(output)
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for worker in self.workers:
            worker.bind(meta)
            if forward:
                for name in LAYER_NAMES:
                    worker.save_kv_layer(name)
            worker.wait_for_save()
            s, r = worker.get_finished(set(output.finished_req_ids))
            sending |= self._all_ranks("send", s)
            recving |= self._all_ranks("recv", r)
            invalid |= worker.take_invalid_block_ids()
            worker.clear()
        out = KVConnectorOutput(sending, recving, invalid)
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
        for worker in self.workers:
            worker.close()
