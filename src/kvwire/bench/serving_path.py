"""The serving path between two processes, for the transfer benchmarks: P's and D's worker connectors
(``KvwireWorkerConnector``, what the built-in engine and the vLLM plugin run) over real transfer
agents, one side per process, driven in lockstep over a pipe.

Rank 0 is P, rank 1 is D. Per transfer: D binds a receive of its blocks (as its scheduler does when
it allocates them, before P's forward ends) and tells P; P then starts the clock, binds the send and
saves every layer as its forward would (``save_kv_layer``, a CUDA event per layer on a GPU); the
clock stops when D's connector reports the request loaded (every layer in D's blocks). The plane is
whatever the agent config names — NCCL between two GPUs, TCP between two CPU processes — and the
agent moves the blocks its fastest way (decision 068): no benchmark-only sender.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.metadata import KvwireConnectorMetadata, RecvSpec, SendSpec
from kvwire.connector.metrics import connector_metrics
from kvwire.connector.worker import KvwireWorkerConnector
from kvwire.protocol.kv_params import Role
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import KVLayout

_STEP_S = 120.0  # one transfer's deadline in the benchmark (a hang fails loudly, never silently)


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """The paged caches of one side: ``layers`` x ``[2, num_blocks, block_size, heads, head_dim]``."""

    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 640  # room for 8192 tokens of one request plus scattered others
    dtype: torch.dtype = torch.bfloat16

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def transfer_bytes(self, tokens: int) -> int:
        per_block = (
            2
            * self.block_size
            * self.heads
            * self.head_dim
            * torch.empty((), dtype=self.dtype).element_size()
        )
        return self.layers * self.blocks_for(tokens) * per_block


class ServingSide:
    """One side's caches, agent and worker connector. Build it in the side's process."""

    def __init__(self, rank: int, geometry: KVGeometry, transfer: TransferConfig) -> None:
        self.rank = rank
        self.geometry = geometry
        self.device = torch.device(transfer.device)
        g = geometry
        shape = (2, g.num_blocks, g.block_size, g.heads, g.head_dim)
        gen = torch.Generator().manual_seed(1234 + rank)
        self.caches = [
            torch.randn(shape, generator=gen).to(dtype=g.dtype, device=self.device) for _ in range(g.layers)
        ]
        role = Role.PREFILL if rank == 0 else Role.DECODE
        info = EngineInfo(block_size=g.block_size, device=str(self.device), kv_layout=KVLayout.KV_FIRST)
        self.connector = KvwireWorkerConnector(
            ConnectorConfig(role=role, use_first_token=False),
            info,
            TransferAgent(transfer),
            metrics=connector_metrics(CollectorRegistry()),
        )
        self.connector.register_kv_caches(self.caches)
        self.timings: list[float] = []  # the agent's own data time of each transfer (seconds)

    @property
    def endpoint(self) -> str:
        return self.connector.kv_endpoint

    def block_ids(self, tokens: int, seed: int) -> list[int]:
        """The request's blocks, scattered among others (different on each side)."""
        gen = torch.Generator().manual_seed(seed * 2 + self.rank)
        ids: list[int] = torch.randperm(self.geometry.num_blocks, generator=gen)[
            : self.geometry.blocks_for(tokens)
        ].tolist()
        return ids

    def digest(self, ids: list[int]) -> str:
        """A hash of the request's blocks of every layer (bit-exact comparison across processes)."""
        h = hashlib.sha256()
        index = torch.tensor(ids, dtype=torch.int64, device=self.device)
        for layer in self.caches:
            h.update(layer.index_select(1, index).view(torch.int16).cpu().numpy().tobytes())
        return h.hexdigest()

    def poison(self, ids: list[int]) -> None:
        index = torch.tensor(ids, dtype=torch.int64, device=self.device)
        for layer in self.caches:
            layer.index_fill_(1, index, 0.0)

    def close(self) -> None:
        self.connector.close()

    # --- one transfer -------------------------------------------------------------------------------

    def transfer(self, conn: Connection, tokens: int, seed: int) -> float | None:
        """Both ranks, in lockstep: one request's KV through the connectors. Rank 0 returns the
        seconds from its first layer handed over to D's connector reporting the request loaded."""
        ids = self.block_ids(tokens, seed)
        if self.rank == 1:
            rid = conn.recv()
            self.connector.bind_connector_metadata(
                KvwireConnectorMetadata(
                    recvs=(RecvSpec(rid, rid, tuple(ids), _STEP_S, pull_from=(), want_trailer=False),)
                )
            )
            self.connector.clear_connector_metadata()
            conn.send(self.endpoint)  # D's receive is bound: P may start
            self._wait(rid, sending=False)
            conn.send(time.perf_counter())
            return None
        rid = uuid.uuid4().hex
        conn.send(rid)
        peer = conn.recv()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the "forward" wrote every layer before t0
        t0 = time.perf_counter()
        send = SendSpec(rid, rid, (peer,), tuple(ids), _STEP_S, with_trailer=False)
        self.connector.bind_connector_metadata(KvwireConnectorMetadata(sends=(send,)))
        for index, layer in enumerate(self.caches):
            self.connector.save_kv_layer(index, layer)
        self.connector.wait_for_save()
        self.connector.clear_connector_metadata()
        self._wait(rid, sending=True)
        end: float = conn.recv()
        return end - t0

    def _wait(self, rid: str, sending: bool) -> None:
        deadline = time.monotonic() + _STEP_S
        while True:
            out = self.connector.get_finished(set())
            if out.failed or out.invalid_block_ids:
                raise RuntimeError(f"transfer {rid} failed: {out.failed or 'invalid blocks'}")
            done = out.finished_sending if sending else out.finished_recving
            if rid in done:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer {rid} did not complete within {_STEP_S} s")
            time.sleep(0.0001)


def run_transfers(
    conn: Connection, side: ServingSide, tokens: int, iters: int, warmup: int = 2
) -> dict[str, Any]:
    """Both ranks: ``warmup + iters`` timed transfers of ``tokens`` tokens, then one verified one
    (D's blocks poisoned first, compared bit for bit with P's). Rank 0 returns the samples."""
    samples = [side.transfer(conn, tokens, seed=i) for i in range(warmup + iters)]
    check_seed = 10_000 + tokens
    ids = side.block_ids(tokens, check_seed)
    if side.rank == 1:
        side.poison(ids)
    side.transfer(conn, tokens, check_seed)
    if side.rank == 1:
        conn.send(side.digest(ids))
        return {}
    verified = conn.recv() == side.digest(ids)
    times = [s for s in samples[warmup:] if s is not None]
    return {"samples_s": times, "verified": verified, "bytes": side.geometry.transfer_bytes(tokens)}
