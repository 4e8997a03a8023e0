"""Llama-3-8B-shaped KV through TransferAgent over NCCL, the way a P/D pair moves it (cuda:0 -> cuda:1).

Reproduces a reported stall: with 32 layers of ``[2, 128 blocks, 16, 8, 128]`` bf16 (2048 tokens:
8 MiB per layer, 256 MiB per transfer) the sender saw every layer acknowledged but the receiver never
reported the transfer finished, and later the NCCL channel was declared stalled. Small layers work
(tests/gpu/test_nccl_agent.py).

Each test mimics production as closely as a test can:

* P (rank 0) has a paged cache of 32 layers ``[2, 1200, 16, 8, 128]`` of random bf16 bits. A push
  transfer is announced before its layers exist; then a "forward" runs: per layer some matmuls on the
  current stream, the gather of the request's blocks, an event, ``send_layer`` (the connector's
  ``save_kv_layer``); the first token follows as the trailer.
* D (rank 1) expects each transfer with a sink that scatters every arrived layer into other blocks of
  its own paged cache, with host-pinned block ids copied inside the sink (the connector's ``_sink``).
* Rounds: three single transfers one after another (the first one is the reported failing case), then
  four concurrent transfers whose layers are interleaved in one forward. Push: the receiver expects
  while the sender computes (the router dispatches P and D concurrently). Pull: the sender holds the
  layers under a lease and the receiver pulls once the sender's "forward" is done.

Both sides stop after the first round that does not complete; on failure the assertion message says
what each side saw (finished sets, failures, sink calls, per-transfer agent bookkeeping, stats).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from kvwire.transfer.memory import KVLayout, gather_blocks, gathered_shape
from support.nccl_planes import child_results, two_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs"),
    pytest.mark.timeout(480),
]

LAYOUT = KVLayout.KV_FIRST
LAYERS = 32
CACHE_BLOCKS = 1200
BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128
CACHE_SHAPE = (2, CACHE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
TOKENS = 2048
BLOCKS = TOKENS // BLOCK_SIZE  # 128 blocks: 8 MiB per layer, 256 MiB per transfer
CACHE_SEED = 8
TRAILER = b"tok"

MATMULS_PER_LAYER = 4  # 4096^3 bf16 each: roughly 1 ms of compute per layer on an H200
DEADLINE_S = 60.0  # the transfers' own deadline
POLL_TIMEOUT_S = 90.0  # how long a side polls one round (past the deadline: failures get reported)
POLL_INTERVAL_S = 0.005
PEER_TIMEOUT_S = 180.0  # a pipe message from the other process (it may be polling a whole round)
CLOSE_TIMEOUT_S = 30.0
RESULTS_TIMEOUT_S = 240.0


def _rounds(mode: str) -> list[list[str]]:
    """Three transfers one after another, then four concurrent ones."""
    return [[f"{mode}-seq{i}"] for i in range(3)] + [[f"{mode}-cc{i}" for i in range(4)]]


def _transfers(mode: str) -> list[str]:
    return [tid for round_tids in _rounds(mode) for tid in round_tids]


def _cache_layer(layer: int) -> torch.Tensor:
    """Layer ``layer`` of P's cache as random int16 bits on the CPU (both processes can rebuild it)."""
    gen = torch.Generator().manual_seed(CACHE_SEED * 1000 + layer)
    return torch.randint(-(2**15), 2**15, CACHE_SHAPE, dtype=torch.int16, generator=gen)


def _src_ids(index: int) -> list[int]:
    """P's blocks of the ``index``-th transfer (scattered over the cache, different per transfer)."""
    gen = torch.Generator().manual_seed(100 + index)
    return torch.randperm(CACHE_BLOCKS, generator=gen)[:BLOCKS].tolist()


def _dst_ids(index: int) -> list[int]:
    """D's blocks of the ``index``-th transfer: disjoint from every other transfer's."""
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(CACHE_BLOCKS, generator=gen)
    return perm[index * BLOCKS : (index + 1) * BLOCKS].tolist()


def _log_to_stderr(role: str) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[{role}] %(asctime)s %(name)s: %(message)s")


def _recv(conn: Connection) -> Any:
    if not conn.poll(PEER_TIMEOUT_S):
        raise AssertionError(f"no message from the other process in {PEER_TIMEOUT_S} s")
    return conn.recv()


def _poll(agent: Any, wanted: set[str], field: str) -> dict[str, Any]:
    """Poll until every wanted transfer is in ``field`` (finished_sending/_recving) or failed, or
    ``POLL_TIMEOUT_S`` passes; failures of any transfer are kept."""
    done: set[str] = set()
    failed: dict[str, str] = {}
    start = time.monotonic()
    while not wanted <= done | failed.keys() and time.monotonic() - start < POLL_TIMEOUT_S:
        events = agent.poll()
        done |= getattr(events, field)
        failed.update(events.failed)
        time.sleep(POLL_INTERVAL_S)
    return {
        "wanted": sorted(wanted),
        "done": sorted(done),
        "failed": failed,
        "timed_out": not wanted <= done | failed.keys(),
        "seconds": round(time.monotonic() - start, 3),
    }


def _ok(outcome: dict[str, Any]) -> bool:
    return not outcome["timed_out"] and not outcome["failed"]


def _agent_state(agent: Any, tids: Sequence[str]) -> dict[str, Any]:
    """Best-effort peek at the agent's per-transfer bookkeeping and counters, for the failure message
    (private fields: diagnostics only; never blocks for long on a wedged agent lock)."""
    try:
        lock = agent._core.lock
        if not lock.acquire(timeout=5.0):
            return {"unavailable": "agent lock busy for 5 s"}
        try:
            out: dict[str, Any] = {"stats": dataclasses.asdict(agent.stats())}
            for tid in tids:
                send = agent._sender.table.get(tid)
                if send is not None:
                    out[f"send {tid}"] = {
                        "handed_over": len(send.items),
                        "granted": len(send.granted),
                        "dispatched": len(send.dispatched),
                        "acked": len(send.acked),
                        "trailer": send.trailer is not None,
                        "trailer_sent": send.trailer_sent,
                        "trailer_acked": send.trailer_acked,
                    }
                recv = agent._receiver.table.get(tid)
                if recv is not None:
                    out[f"recv {tid}"] = {
                        "expected": recv.expected,
                        "offered_layers": None if recv.specs is None else len(recv.specs),
                        "to_grant": len(recv.to_grant),
                        "posted_not_arrived": sorted(recv.granted),
                        "held": sorted(recv.held),
                        "delivering": sorted(recv.delivering),
                        "arrived": len(recv.arrived),
                        "with_trailer": recv.with_trailer,
                        "trailer": recv.trailer is not None,
                    }
                if send is None and recv is None:
                    out[tid] = "no live state (ended, or never seen)"
            return out
        finally:
            lock.release()
    except Exception as exc:  # the internals moved: say so rather than hide the real failure
        return {"unavailable": repr(exc)}


def _close(agent: Any) -> str:
    """Close on a helper thread so that a wedged close cannot keep the results from the parent."""
    error: list[str] = []

    def close() -> None:
        try:
            agent.close()
        except Exception as exc:
            error.append(repr(exc))

    closer = threading.Thread(target=close, name="close-agent", daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_S)
    if closer.is_alive():
        return f"close() still running after {CLOSE_TIMEOUT_S} s"
    return f"close() raised {error[0]}" if error else "closed"


def _forward(
    agent: Any, cache: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor, sends: dict[str, torch.Tensor]
) -> None:
    """One prefill forward on P: each layer computes on the current stream, then every send of this
    step gets that layer's blocks gathered and handed over with a ready event (``save_kv_layer``)."""
    out = torch.empty_like(x)
    for layer in range(LAYERS):
        for _ in range(MATMULS_PER_LAYER):
            torch.mm(x, w, out=out)  # values are irrelevant: it keeps the stream busy like attention/MLP
        for tid, ids in sends.items():
            data = gather_blocks(cache[layer], ids, LAYOUT)
            ready = torch.cuda.Event()
            ready.record()
            agent.send_layer(tid, layer, data, ready_event=ready)


def _sender(conn: Connection, mode: str) -> dict[str, Any]:
    from kvwire.transfer import Backend, LayerSpec, TransferAgent, TransferConfig

    _log_to_stderr("P cuda:0")
    device = torch.device("cuda:0")
    cache = [_cache_layer(layer).to(device).view(torch.bfloat16) for layer in range(LAYERS)]
    x = torch.randn(4096, 4096, device=device).to(torch.bfloat16)
    w = torch.randn(4096, 4096, device=device).to(torch.bfloat16) / 64
    transfers = _transfers(mode)
    ids = {tid: torch.tensor(_src_ids(i), device=device) for i, tid in enumerate(transfers)}
    specs = [LayerSpec(gathered_shape(cache[0], BLOCKS, LAYOUT), torch.bfloat16)] * LAYERS
    agent = TransferAgent(TransferConfig(backend=Backend.NCCL, transport="nccl", device="cuda:0"))
    report: dict[str, Any] = {"rounds": []}
    try:
        peer: str = _recv(conn)
        conn.send(agent.endpoint)
        for tids in _rounds(mode):
            if mode == "push":
                conn.send(tids)  # D expects these while P computes (concurrent dispatch)
            for tid in tids:
                endpoint = peer if mode == "push" else None  # pull: hold under a lease until D pulls
                agent.start_send(tid, endpoint, specs, deadline_s=DEADLINE_S, with_trailer=True)
            _forward(agent, cache, x, w, {tid: ids[tid] for tid in tids})
            for tid in tids:
                agent.send_trailer(tid, TRAILER)
            if mode == "pull":
                conn.send(tids)  # P answered: D gets the params and pulls
            outcome = _poll(agent, set(tids), "finished_sending")
            conn.send(_ok(outcome))
            peer_ok = _recv(conn)
            if not (_ok(outcome) and peer_ok):
                late = agent.poll()  # e.g. a stalled channel reported after this side was done
                outcome["late_failed"] = late.failed
                outcome["agent"] = _agent_state(agent, tids)
            report["rounds"].append(outcome)
            if not (_ok(outcome) and peer_ok):
                break
    finally:
        report["final"] = _agent_state(agent, transfers)
        report["close"] = _close(agent)
    return report


def _receiver(conn: Connection, mode: str) -> dict[str, Any]:
    from kvwire.transfer import Backend, LayerSink, TransferAgent, TransferConfig
    from kvwire.transfer.memory import scatter_blocks

    _log_to_stderr("D cuda:1")
    device = torch.device("cuda:1")
    dst = [torch.zeros(CACHE_SHAPE, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
    transfers = _transfers(mode)
    # Host-side ids, pinned: the sink copies them on its own (delivery) stream, like the connector.
    host_ids = {
        tid: torch.tensor(_dst_ids(i), dtype=torch.int64).pin_memory() for i, tid in enumerate(transfers)
    }
    sunk: Counter[str] = Counter()
    sunk_lock = threading.Lock()

    def make_sink(tid: str) -> LayerSink:
        def sink(layer: int, tensor: torch.Tensor) -> None:  # a transfer thread of the agent
            ids = host_ids[tid].to(dst[layer].device, non_blocking=True)
            scatter_blocks(dst[layer], ids, tensor, LAYOUT)
            with sunk_lock:
                sunk[tid] += 1

        return sink

    agent = TransferAgent(TransferConfig(backend=Backend.NCCL, transport="nccl", device="cuda:1"))
    report: dict[str, Any] = {"rounds": [], "trailers": {}, "exact": {}, "stray_layers": []}
    expected: list[str] = []
    try:
        conn.send(agent.endpoint)
        peer: str = _recv(conn)
        for _ in _rounds(mode):
            tids: list[str] = _recv(conn)
            for tid in tids:
                pull_from = peer if mode == "pull" else None
                agent.expect(
                    tid, num_layers=LAYERS, sink=make_sink(tid), deadline_s=DEADLINE_S, pull_from=pull_from
                )
                expected.append(tid)
            outcome = _poll(agent, set(tids), "finished_recving")
            for tid in set(tids) & set(outcome["done"]):
                report["trailers"][tid] = agent.take_trailer(tid)
            with sunk_lock:
                outcome["sink_calls"] = {tid: sunk[tid] for tid in tids}
            if not _ok(outcome):
                outcome["agent"] = _agent_state(agent, tids)
            conn.send(_ok(outcome))
            peer_ok = _recv(conn)
            report["rounds"].append(outcome)
            if not (_ok(outcome) and peer_ok):
                break
    finally:
        report["final"] = _agent_state(agent, transfers)
        report["close"] = _close(agent)
    finished = [tid for outcome in report["rounds"] for tid in outcome["done"]]
    report["exact"], report["stray_layers"] = _verify(dst, transfers, finished, expected)
    return report


def _verify(
    dst: list[torch.Tensor], transfers: list[str], finished: list[str], expected: list[str]
) -> tuple[dict[str, bool], list[int]]:
    """Bit-exactness of every finished transfer (D's blocks vs P's, rebuilt from the seed), and the
    layers where a block no transfer was aimed at is no longer zero."""
    device = dst[0].device
    exact = dict.fromkeys(finished, True)
    aimed = {b for tid in expected for b in _dst_ids(transfers.index(tid))}
    untouched = torch.tensor(sorted(set(range(CACHE_BLOCKS)) - aimed), device=device)
    stray: list[int] = []
    for layer in range(LAYERS):
        want_layer = _cache_layer(layer)
        got_layer = dst[layer].view(torch.int16)
        for tid in finished:
            index = transfers.index(tid)
            want = gather_blocks(want_layer, torch.tensor(_src_ids(index)), LAYOUT)
            got = gather_blocks(got_layer, torch.tensor(_dst_ids(index), device=device), LAYOUT).cpu()
            exact[tid] = exact[tid] and torch.equal(want, got)
        if bool(gather_blocks(got_layer, untouched, LAYOUT).any()):
            stray.append(layer)
    return exact, stray


def _story(sender: dict[str, Any], receiver: dict[str, Any]) -> str:
    lines = []
    for side, report in (("P (sender, cuda:0)", sender), ("D (receiver, cuda:1)", receiver)):
        lines.append(f"{side}:")
        for index, outcome in enumerate(report["rounds"]):
            lines.append(f"  round {index}: {outcome}")
        for key in ("trailers", "exact", "stray_layers", "final", "close"):
            if key in report:
                lines.append(f"  {key}: {report[key]}")
    return "\n".join(lines)


def _run(spawn: Any, mode: str) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_sender, 0, left, mode)
    spawn(_receiver, 1, right, mode)
    results = child_results(spawn.queue, 2, timeout_s=RESULTS_TIMEOUT_S)
    sender, receiver = results["_sender"], results["_receiver"]
    story = _story(sender, receiver)
    rounds = _rounds(mode)
    transfers = _transfers(mode)
    for report in (sender, receiver):
        assert len(report["rounds"]) == len(rounds), f"stopped after a failed round\n{story}"
        assert all(_ok(outcome) for outcome in report["rounds"]), story
    assert receiver["exact"] == dict.fromkeys(transfers, True), story
    assert receiver["trailers"] == dict.fromkeys(transfers, TRAILER), story
    assert receiver["stray_layers"] == [], story
    assert (sender["close"], receiver["close"]) == ("closed", "closed"), story


def test_llama8b_layerwise_push_over_nccl(spawn: Any) -> None:
    _run(spawn, "push")


def test_llama8b_layerwise_pull_over_nccl(spawn: Any) -> None:
    _run(spawn, "pull")
