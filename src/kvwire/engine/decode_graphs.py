"""Decode steps replayed from CUDA graphs (opt-in: ``EngineConfig.decode_graphs``).

Eager decoding of a large model at small batch is bound by kernel launches, not by the GPU. A
decode-only step has a fixed shape once the batch is padded to a bucket (1, 2, 4, ... max_num_seqs) and
the block tables to a width bucket (1, 2, 4, ... blocks of the model length). Each (batch, width) pair
is captured once into a CUDA graph that reads static input buffers; a step fills the buffers and
replays the graph. Padding rows write their KV into a scratch block that no request owns.

On the CPU the same static-shape path runs eagerly (nothing is captured): that is how the tests check
it. It is used only with the no-op worker connector, because a replay skips the per-layer connector
hooks. The output of a replay is consumed (logits taken) before the next replay: graphs share one
memory pool.
"""

from __future__ import annotations

from typing import Any

import torch

from kvwire.engine.attention import AttentionMetadata, ForwardContext
from kvwire.engine.config import AttentionBackend
from kvwire.engine.models.llama import LlamaModel


def _buckets(limit: int) -> list[int]:
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(min(2 * sizes[-1], limit))
    return sizes


def _bucket(sizes: list[int], n: int) -> int:
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    """Engine thread. Owns the static buffers and the captured graphs."""

    def __init__(
        self, model: LlamaModel, kv_caches: list[torch.Tensor], scratch_block: int, max_batch: int,
        max_blocks: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.block_size = kv_caches[0].shape[2]
        self.scratch_block = scratch_block
        self.batch_sizes, self.widths = _buckets(max_batch), _buckets(max_blocks)
        self.capture = device.type == "cuda"
        rows, cols = self.batch_sizes[-1], self.widths[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.full((rows, cols), scratch_block, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the memory pool the graphs share

    def fits(self, batch_size: int, num_blocks: int) -> bool:
        return batch_size <= self.batch_sizes[-1] and num_blocks <= self.widths[-1]

    def capture_all(self) -> None:
        """Capture every (batch, width) graph now rather than on first use (largest first, as they
        share one memory pool). The inputs are all padding: only the scratch block is written."""
        if not self.capture:
            return
        with torch.inference_mode():
            for batch in reversed(self.batch_sizes):
                for width in reversed(self.widths):
                    if (batch, width) not in self.graphs:
                        self._fill(batch, width, [], [], [], [])
                        self._capture(batch, width)

    def run(
        self, input_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """One decode token per sequence -> hidden states [n, hidden] (valid until the next call)."""
        n = len(input_ids)
        batch = _bucket(self.batch_sizes, n)
        width = _bucket(self.widths, max(len(t) for t in block_tables))
        self._fill(batch, width, input_ids, positions, slots, block_tables)
        if not self.capture:
            return self._forward(batch, width)[:n]
        entry = self.graphs.get((batch, width)) or self._capture(batch, width)
        entry[0].replay()
        return entry[1][:n]

    def _fill(
        self, batch: int, width: int, input_ids: list[int], positions: list[int], slots: list[int],
        block_tables: list[list[int]],
    ) -> None:  # fmt: skip
        pad = batch - len(input_ids)
        scratch_slot = self.scratch_block * self.block_size
        # Padding (columns and rows) points at the scratch block. One host tensor for the whole table.
        rows = [blocks + [self.scratch_block] * (width - len(blocks)) for blocks in block_tables]
        rows += [[self.scratch_block] * width] * (batch - len(rows))
        table = torch.tensor(rows, dtype=torch.int64).view(batch, width)
        seq_lens = [p + 1 for p in positions] + [1] * pad
        for static, values in (
            (self.input_ids, input_ids + [0] * pad),
            (self.positions, positions + [0] * pad),
            (self.slots, slots + [scratch_slot] * pad),
            (self.seq_lens, seq_lens),
        ):
            static[:batch].copy_(torch.tensor(values), non_blocking=True)
        self.block_tables[:batch, :width].copy_(table, non_blocking=True)

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:batch],
            block_tables=self.block_tables[:batch, :width],
            seq_lens_t=self.seq_lens[:batch],
            query_start_loc=list(range(batch + 1)),
            seq_lens=[0] * batch,  # host copy: not read when every sequence decodes (num_decodes = batch)
            num_decodes=batch,
            block_size=self.block_size,
        )
        ctx = ForwardContext(meta, self.kv_caches, None, AttentionBackend.SDPA)
        return self.model(self.input_ids[:batch], self.positions[:batch], ctx)

    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (kernel choice, workspaces), then record. The warm-up writes the
        # current step's K/V into its own slots: the replay right after writes the same values.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(batch, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work on other threads (e.g. a transfer agent) does not break the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(batch, width)
        self.pool = graph.pool()
        self.graphs[(batch, width)] = (graph, out)
        return graph, out
