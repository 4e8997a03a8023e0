"""Runs one step's forward pass: packs the scheduled tokens, samples, inside the worker connector.
Read in order: :class:`ModelRunner`, then the sampling at the end of this module (each request's
:class:`SamplingParams` and the :class:`Sampler`).

One connector call a step (decision 131): ``run_step`` binds the step's metadata, starts loads, runs
the forward given to it (each attention layer calls ``wait_for_layer_load`` / ``save_kv_layer`` on
the layer hooks ``run_step`` hands it, see attention.py; none when the connector has no per-layer
work in the step), finishes the saves and reports. It runs even when no token is scheduled, so that
transfers of requests waiting for remote KV keep being reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from kvwire.connector.base import ConnectorMetadata, ConnectorOutput, NoOpWorkerConnector, WorkerConnector
from kvwire.connector.kv_cache import allocate_kv_caches
from kvwire.engine.attention import AttentionMetadata, ForwardContext, resolve_backend
from kvwire.engine.config import EngineConfig
from kvwire.engine.decode_graphs import DecodeGraphs
from kvwire.engine.models.llama import LlamaModel
from kvwire.engine.scheduler import ScheduledRequest
from kvwire.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from kvwire.engine.llm_engine import Request


@dataclasses.dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> next token, for requests whose last token was computed
    connector_output: ConnectorOutput


def kv_cache_bytes_per_block(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    return cfg.num_layers * 2 * block_size * model.num_local_kv_heads * cfg.head_dim * dtype.itemsize


def num_kv_blocks_for(config: EngineConfig, model: LlamaModel, dtype: torch.dtype, max_model_len: int) -> int:
    """Blocks for the KV cache when the config does not say: what ``max_num_seqs`` full-length
    sequences need, capped by memory (CUDA: a fraction of what is free after the weights, and of
    what is left of this instance's share of the device when ``gpu_memory_utilization`` is set)."""
    per_block = kv_cache_bytes_per_block(model, config.block_size, dtype)
    wanted = config.max_num_seqs * -(-max_model_len // config.block_size)
    if config.is_cuda:
        device = torch.device(config.device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        budget = int(cuda_kv_budget(config, free_bytes, total_bytes, torch.cuda.memory_reserved(device)))
    else:
        budget = config.cpu_kv_cache_bytes
    return max(1, min(wanted, budget // per_block))


def cuda_kv_budget(config: EngineConfig, free_bytes: int, total_bytes: int, held_bytes: int) -> float:
    """Bytes the KV cache may take on a GPU with ``free_bytes`` of ``total_bytes`` free while this
    process holds ``held_bytes`` (its weights): ``kv_cache_memory_fraction`` of the free memory, or
    of what is left of the instance's ``gpu_memory_utilization`` share when that is smaller (the rest
    is the forward's working memory). Raises ConfigError when the weights alone fill the share."""
    room = free_bytes
    share = config.gpu_memory_utilization
    if share is not None:
        left = total_bytes * share - held_bytes
        if left <= 0:
            gib = 1 << 30
            raise ConfigError(
                f"gpu_memory_utilization {share} gives this instance {total_bytes * share / gib:.1f} GiB of "
                f"{config.device}'s {total_bytes / gib:.1f} GiB, and the model already holds "
                f"{held_bytes / gib:.1f} GiB: raise it or run fewer instances on the GPU"
            )
        room = min(room, int(left))
    return room * config.kv_cache_memory_fraction


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
        self.backend = resolve_backend(config.attention_backend, device, dtype)
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


# --- sampling -------------------------------------------------------------------------------------
# Per-request sampling parameters (frozen, validated: bad values raise InvalidRequestError).
#
# Sampling the next token from logits: greedy, temperature, top-k, top-p, per-request seeds.
#
# Greedy rows take the argmax. The other rows are filtered together (temperature, then top-k, then
# top-p over what is left) and drawn with ``torch.multinomial``: rows with their own seed from their own
# generator (so a seeded request samples the same tokens whatever it is batched with), the rest in one
# draw from the engine's generator.

GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # output tokens at most (the model length may end a request earlier)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request torch.Generator seed; None = the engine's generator
    stop: Sequence[str] = ()  # stop strings: the text ends before the first match
    stop_token_ids: Sequence[int] = ()  # tokens that end the request (kept in token_ids)
    ignore_eos: bool = False
    # The last N prompt tokens are this answer's own earlier output (an answer migrated from a dead
    # instance, decision 052): detokenization and stop strings continue from them, so the text
    # equals an uninterrupted run's even across a character split by the migration.
    prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")
        stop_ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers")
        prior = self.prior_output_tokens
        if isinstance(prior, bool) or not isinstance(prior, int) or prior < 0:
            raise InvalidRequestError(f"prior_output_tokens must be an integer >= 0, got {prior!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy (dividing by them would overflow)."""
        return self.temperature < GREEDY_TEMPERATURE


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """logits: [N, vocab] fp32, one row per request -> N token ids (one host sync)."""
        tokens = logits.argmax(dim=-1)  # [N]; greedy rows keep this
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            probs = filtered_probs(logits[rows], [params[i] for i in rows])  # [R, vocab]
            shared = [j for j, i in enumerate(rows) if generators[i] is None]
            if shared:
                drawn = torch.multinomial(probs[shared], 1, generator=self.generator)[:, 0]
                tokens[[rows[j] for j in shared]] = drawn
            for j, i in enumerate(rows):
                gen = generators[i]
                if gen is not None:
                    tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return [int(t) for t in tokens.tolist()]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, vocab] logits -> probabilities after each row's temperature, top-k and top-p."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_logits, order = (logits / temperature).sort(dim=-1, descending=True)  # [R, vocab]
    rank = torch.arange(vocab, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(dim=-1))
