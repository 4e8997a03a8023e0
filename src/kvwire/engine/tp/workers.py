"""Ranks 1..N-1 of a tensor-parallel engine: separate processes that follow rank 0 step by step.

Start-up (rank 0 drives it, every wait bounded): spawn the workers; each loads the model, keeps its
shard and says "loaded" over its pipe (or why not); all ranks join the torch.distributed group;
rank 0 sends the KV sizing; each worker builds its KV cache and worker connector (its own transfer
agent) and answers with the agent's endpoint. Then, each step, rank 0 sends the scheduled batch and
the connector metadata; every rank runs the same forward (the all-reduces pair them up) and the
workers answer with their connector reports. ``None`` stops a worker. A worker whose parent dies
stops by itself. Once serving, a worker that exits, reports an error or does not answer within the
timeout raises :class:`~kvwire.errors.RankLost` on rank 0 (the engine then ends; decision 085); a rank
lost mid-step makes the others' all-reduce fail (gloo: at once, the peer's socket closed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.engine.config import EngineConfig
from kvwire.engine.tp.group import TPGroup, create_store, rank_device
from kvwire.engine.tp.shard import set_all_reduce
from kvwire.engine.tp.step_messages import Sizes, StepMessage, WorkerConnectorFactory, from_message
from kvwire.errors import RankLost

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a waiting side checks that its peer process still lives


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    rank: int
    size: int
    config: EngineConfig
    store_port: int
    timeout_s: float
    connector_factory: WorkerConnectorFactory | None
    num_threads: int


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(name)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    connector = None
    try:
        model, config = _load(spec)
        conn.send(("loaded", None))
        group = TPGroup(spec.rank, spec.size, spec.store_port, config.device, spec.timeout_s)
        set_all_reduce(model, group.all_reduce)
        sizes = _recv(conn)
        if not isinstance(sizes, Sizes):
            return
        from kvwire.connector.base import NoOpWorkerConnector
        from kvwire.engine.model_runner import ModelRunner

        connector = spec.connector_factory(spec.rank) if spec.connector_factory else NoOpWorkerConnector()
        runner = ModelRunner(
            config, model, sizes.num_blocks, connector, torch.device(config.device),
            next(model.parameters()).dtype, sizes.max_model_len, samples=False,
        )  # fmt: skip
        conn.send(("ready", getattr(connector, "kv_endpoint", None)))
        while (msg := _recv(conn)) is not None:
            if msg == "stats":  # for tests and introspection: what this rank still tracks
                stats = {name: int(getattr(connector, name, 0))
                         for name in ("num_live_transfers", "bytes_sent", "bytes_received")}  # fmt: skip
                conn.send(("stats", stats))
                continue
            assert isinstance(msg, StepMessage)
            result = runner.execute(from_message(msg), msg.metadata, msg.finished_ids)
            conn.send(("step", result.connector_output))
    except Exception as exc:  # reported to rank 0, which fails the engine with it
        log.exception("tensor-parallel rank %d failed", spec.rank)
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if connector is not None:
            connector.close()


def _load(spec: WorkerSpec) -> tuple[Any, EngineConfig]:
    from kvwire.engine.loader import load_model
    from kvwire.engine.tp.shard import shard_model

    config = dataclasses.replace(spec.config, device=rank_device(spec.config.device, spec.rank))
    loaded = load_model(config)
    shard_model(loaded.model, spec.rank, spec.size, None)  # all_reduce bound once the group forms
    return loaded.model, config


def _recv(conn: Connection) -> Any:
    """The next message from rank 0; None when told to stop or when rank 0 is gone."""
    parent = mp.parent_process()
    while not conn.poll(_POLL_S):
        if parent is not None and not parent.is_alive():
            return None
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


class Workers:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(
        self, config: EngineConfig, factory: WorkerConnectorFactory | None, timeout_s: float
    ) -> None:
        size = config.tensor_parallel_size
        self.timeout_s = timeout_s
        self.store = create_store(timeout_s)
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(
                rank, size, config, self.store.port, timeout_s, factory, torch.get_num_threads()
            )
            proc = ctx.Process(target=worker_main, args=(spec, theirs), name=f"kvwire-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    def _lost(self, rank: int, what: str) -> RankLost:
        return RankLost(f"tensor-parallel rank {rank} of {len(self._procs) + 1} {what}")

    def expect(self, kind: str, timeout_s: float | None = None) -> list[Any]:
        """Each worker's next message, which must be ``kind``; RankLost (an EngineError) when a
        worker exits, errs, answers something else or nothing before the timeout."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        out = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            while not conn.poll(_POLL_S):
                if not proc.is_alive():
                    raise self._lost(rank, f"exited (code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise self._lost(rank, f"did not answer within {timeout_s or self.timeout_s} s")
            try:
                got, payload = conn.recv()
            except (EOFError, OSError) as exc:
                raise self._lost(rank, f"is gone: {exc!r}") from exc
            if got != kind:
                raise self._lost(rank, f"failed: {payload}" if got == "error" else f"answered {got!r}")
            out.append(payload)
        return out

    def send(self, msg: object) -> None:
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(msg)
            except OSError as exc:
                raise self._lost(rank, f"is gone: {exc!r}") from exc

    def name_lost(self, error: RankLost, wait_s: float = 1.0) -> RankLost:
        """A failed all-reduce does not say which peer is gone: the rank whose process exited
        within ``wait_s`` (its death is what broke the socket), else ``error`` itself."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check()
            except RankLost as named:
                return named
            if time.monotonic() > deadline:
                return error
            time.sleep(0.05)

    def check(self) -> None:
        """Raise RankLost if a worker process is no longer alive (cheap: no message)."""
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                raise self._lost(rank, f"exited (code {proc.exitcode})")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (a stop message, then terminate, then kill), bounded by ``timeout_s``."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]
