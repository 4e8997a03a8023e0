"""Runs one step's forward pass: packs the scheduled tokens, samples, inside the worker connector.

One connector call a step (decision 131): ``run_step`` binds the step's metadata, starts loads, runs
the forward given to it (each attention layer calls ``wait_for_layer_load`` / ``save_kv_layer`` on
the layer hooks ``run_step`` hands it, see attention.py; none when the connector has no per-layer
work in the step), finishes the saves and reports. It runs even when no token is scheduled, so that
transfers of requests waiting for remote KV keep being reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from kvwire.connector.base import ConnectorMetadata, ConnectorOutput, NoOpWorkerConnector, WorkerConnector
from kvwire.connector.kv_cache import allocate_kv_caches
from kvwire.engine.attention import AttentionMetadata, ForwardContext
from kvwire.engine.config import AttentionBackend, EngineConfig
from kvwire.engine.decode_graphs import DecodeGraphs
from kvwire.engine.models.llama import LlamaModel
from kvwire.engine.request import Request
from kvwire.engine.sampler import Sampler
from kvwire.engine.scheduler import ScheduledRequest


@dataclasses.dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> next token, for requests whose last token was computed
    connector_output: ConnectorOutput


def kv_cache_bytes_per_block(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    return cfg.num_layers * 2 * block_size * model.num_local_kv_heads * cfg.head_dim * dtype.itemsize


def num_kv_blocks_for(config: EngineConfig, model: LlamaModel, dtype: torch.dtype, max_model_len: int) -> int:
    """Blocks for the KV cache when the config does not say: what ``max_num_seqs`` full-length
    sequences need, capped by memory (CUDA: a fraction of what is free after the weights)."""
    per_block = kv_cache_bytes_per_block(model, config.block_size, dtype)
    wanted = config.max_num_seqs * -(-max_model_len // config.block_size)
    if config.is_cuda:
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(free_bytes * config.kv_cache_memory_fraction)
    else:
        budget = config.cpu_kv_cache_bytes
    return max(1, min(wanted, budget // per_block))


class ModelRunner:
    """Engine thread. Owns the KV cache: one ``[2, num_blocks, block_size, kv_heads, head_dim]``
    tensor per layer, zero-initialised (stale or padded slots are masked, never NaN)."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        num_blocks: int,
        connector: WorkerConnector,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        *,
        samples: bool = True,
    ) -> None:
        cfg = model.config
        self.samples = samples  # False on tensor-parallel ranks > 0: they compute, rank 0 samples
        self.model = model
        self.device = device
        self.block_size = config.block_size
        self.connector = connector
        backend = config.attention_backend
        self.backend = AttentionBackend.SDPA if backend is AttentionBackend.AUTO else backend
        use_graphs = (
            config.decode_graphs and isinstance(connector, NoOpWorkerConnector) and model.tp_size == 1
        )
        # With graphs, one more block than the block manager knows: the padding rows' scratch block.
        shape = (2, num_blocks + int(use_graphs), config.block_size, model.num_local_kv_heads, cfg.head_dim)
        # CPU: in shared memory, where a peer on this host writes KV into it directly
        self.kv_caches = allocate_kv_caches(shape, cfg.num_layers, dtype, device)
        connector.register_kv_caches(self.kv_caches)
        self.sampler = Sampler(device, config.seed)
        self.graphs = (
            DecodeGraphs(model, self.kv_caches, num_blocks, config.max_num_seqs,
                         -(-max_model_len // config.block_size), device)
            if use_graphs else None
        )  # fmt: skip

    def execute(
        self, scheduled: list[ScheduledRequest], metadata: ConnectorMetadata, finished_ids: Iterable[str]
    ) -> StepResult:
        def forward(layer_hooks: WorkerConnector | None) -> dict[str, int]:
            return self._forward_and_sample(scheduled, layer_hooks) if scheduled else {}

        sampled, output = self.connector.run_step(metadata, frozenset(finished_ids), forward)
        return StepResult(sampled, output)

    @torch.inference_mode()
    def _forward_and_sample(
        self, scheduled: list[ScheduledRequest], layer_hooks: WorkerConnector | None
    ) -> dict[str, int]:
        # Decodes (one new token) first: attention batches them over gathered blocks.
        batch = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        hidden, query_start_loc = self._forward(batch, layer_hooks)  # [T, hidden]
        rows = [i for i, s in enumerate(batch) if s.samples]
        if not rows or not self.samples:
            return {}
        last_token = torch.tensor([query_start_loc[i + 1] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last_token])  # [N, vocab]
        requests = [batch[i].request for i in rows]
        tokens = self.sampler.sample(logits, [r.params for r in requests], [r.generator for r in requests])
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}

    def _forward(
        self, batch: list[ScheduledRequest], layer_hooks: WorkerConnector | None
    ) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of the packed new tokens, and where each sequence's tokens start.
        ``layer_hooks``: the worker connector the attention layers call, None when it has no
        per-layer work in this step."""
        widest = max(len(s.request.block_ids) for s in batch)
        if (
            self.graphs is not None
            and all(s.num_new_tokens == 1 for s in batch)
            and self.graphs.fits(len(batch), widest)
        ):
            reqs = [s.request for s in batch]
            positions = [r.num_computed_tokens for r in reqs]
            hidden = self.graphs.run(
                [r.all_token_ids[p] for r, p in zip(reqs, positions, strict=True)],
                positions,
                [self._slot(r, p) for r, p in zip(reqs, positions, strict=True)],
                [r.block_ids for r in reqs],
            )
            return hidden, list(range(len(batch) + 1))
        input_ids, positions_t, meta = self._prepare(batch)
        ctx = ForwardContext(meta, self.kv_caches, layer_hooks, self.backend)
        split = self.model.row_split
        if split is None:
            return self.model(input_ids, positions_t, ctx), meta.query_start_loc
        split.packed_rows = meta.num_decodes  # decodes come first: packed kernels; prompt rows dense
        try:
            return self.model(input_ids, positions_t, ctx), meta.query_start_loc
        finally:
            split.packed_rows = None

    def _slot(self, req: Request, position: int) -> int:
        return req.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Pack the new tokens of every sequence; slot = block_id * block_size + offset."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens = [0], []
        max_blocks = max(len(s.request.block_ids) for s in batch)
        block_tables = [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in batch]
        for item in batch:
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += req.all_token_ids[start:end]
            positions += range(start, end)
            slots += [self._slot(req, p) for p in range(start, end)]
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            block_tables=torch.tensor(block_tables, dtype=torch.int64).to(self.device, non_blocking=True),
            seq_lens_t=self._to_device(seq_lens),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            num_decodes=sum(1 for s in batch if s.num_new_tokens == 1),
            block_size=self.block_size,
        )
        return self._to_device(input_ids), self._to_device(positions), meta

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)
