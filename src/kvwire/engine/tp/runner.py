"""Rank 0 of a tensor-parallel engine: starts the other ranks and runs each step on all of them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvwire.connector.base import ConnectorMetadata
from kvwire.connector.metadata import KvwireConnectorMetadata
from kvwire.engine.config import EngineConfig
from kvwire.engine.model_runner import ModelRunner, StepResult
from kvwire.engine.models.config import ModelConfig
from kvwire.engine.scheduler import ScheduledRequest
from kvwire.engine.tp.aggregate import OutputAggregator
from kvwire.engine.tp.group import TPGroup
from kvwire.engine.tp.shard import check_shardable, shard_model
from kvwire.engine.tp.step_messages import Sizes, WorkerConnectorFactory, to_message
from kvwire.engine.tp.workers import Workers
from kvwire.errors import RankLost

log = logging.getLogger(__name__)


def model_config_of(config: EngineConfig) -> ModelConfig:
    """The model's shapes without loading its weights: a preset's, a packaged model's or a GGUF
    file's metadata, or the directory's config.json (the same names ``loader.load_model`` takes)."""
    from kvwire.engine.models.presets import PACKAGED_MODELS, PRESETS
    from kvwire.engine.weights import read_model_config

    if config.model in PRESETS:
        return PRESETS[config.model].config
    path = PACKAGED_MODELS[config.model].path(config.model) if config.model in PACKAGED_MODELS else None
    if path is None and (config.model.endswith(".gguf") or Path(config.model).is_file()):
        path = Path(config.model)
    if path is not None:
        from kvwire.engine.gguf_reader import GGUFFile
        from kvwire.engine.gguf_weights import gguf_model_config

        return gguf_model_config(GGUFFile(path))
    return read_model_config(Path(config.model))


class TPLeader:
    """Rank 0's side of the start-up handshake (see workers.py); ``close`` stops the workers."""

    def __init__(self, config: EngineConfig, factory: WorkerConnectorFactory | None) -> None:
        check_shardable(model_config_of(config), config.tensor_parallel_size)
        self.size = config.tensor_parallel_size
        self.timeout_s = config.tp_timeout_s
        self.workers = Workers(config, factory, config.tp_timeout_s)

    def shard(self, model: Any, device: str) -> None:
        """After rank 0 loaded the model: wait for the workers' models, form the group, shard."""
        self.workers.expect("loaded")
        group = TPGroup(0, self.size, self.workers.store.port, device, self.timeout_s, self.workers.store)
        shard_model(model, 0, self.size, group.all_reduce)

    def start_runners(self, num_blocks: int, max_model_len: int) -> list[str | None]:
        """Workers allocate their KV caches; returns their agents' endpoints (rank 1..N-1)."""
        self.workers.send(Sizes(num_blocks, max_model_len))
        return list(self.workers.expect("ready"))

    def close(self) -> None:
        self.workers.close()


class TPRunner:
    """Stands in for rank 0's ModelRunner: every step goes to every rank; the connector reports
    are merged (aggregate.py)."""

    def __init__(self, local: ModelRunner, leader: TPLeader) -> None:
        self.local = local
        self.leader = leader
        self.sampler = local.sampler
        self.kv_caches: list[torch.Tensor] = local.kv_caches
        self.graphs = None  # decode graphs need one process
        self.backend = local.backend
        self.aggregator = OutputAggregator(leader.size)

    def execute(
        self, scheduled: list[ScheduledRequest], metadata: ConnectorMetadata, finished_ids: Iterable[str]
    ) -> StepResult:
        aborts = self.aggregator.take_aborts()
        if aborts and isinstance(metadata, KvwireConnectorMetadata):
            metadata = dataclasses.replace(metadata, aborts=metadata.aborts + aborts)
        self.aggregator.note_metadata(metadata)
        finished = frozenset(finished_ids)
        self.leader.workers.send(to_message(scheduled, metadata, finished))
        try:
            result = self.local.execute(scheduled, metadata, finished)
        except RankLost as exc:  # the all-reduce broke: name the rank that is gone
            raise self.leader.workers.name_lost(exc) from exc
        outputs = [result.connector_output, *self.leader.workers.expect("step")]
        return StepResult(result.sampled, self.aggregator.merge(outputs))

    def worker_stats(self) -> list[dict[str, int]]:
        """Ranks 1..N-1: transfers their connectors still track (engine thread, between steps)."""
        self.leader.workers.send("stats")
        return list(self.leader.workers.expect("stats"))
