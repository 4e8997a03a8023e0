"""What each of the two benchmark processes runs, in lockstep (see :mod:`kvwire.bench.transfer_nccl`)."""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvwire.bench import nccl_extras as extras
from kvwire.bench import nccl_harness as h
from kvwire.bench import nccl_workers as w
from kvwire.bench.serving_path import KVGeometry, ServingSide, run_transfers
from kvwire.transfer import Backend, TransferConfig
from kvwire.transfer.enums import Transport
from kvwire.transfer.planes.common.group_kernels import PagedLayers
from kvwire.transfer.planes.nccl.bindings import abort_all, load_nccl
from kvwire.transfer.planes.nccl.plane import NcclPlaneConfig

MiB = 1 << 20
WARMUP = 3
PROFILED = 5  # --profile: iterations of (a) and (c) traced per size


def _size_row(
    conn: Connection,
    rank: int,
    comms: list[Any],
    serving: ServingSide,
    side: w.KvwireSide,
    cache: list[torch.Tensor],
    shape: w.KVShape,
    tokens: int,
    iters: int,
    profile: str | None = None,
) -> dict[str, Any]:
    ids = w.block_ids(shape, tokens, cache[0].device, seed=1000 * tokens + rank)
    num_bytes = shape.layers * shape.layer_bytes(tokens)
    comm = comms[0]
    a_plain = w.ceiling(conn, rank, comm, num_bytes, WARMUP + iters)[WARMUP:]
    # (a) both ways, and the faster is the ceiling: NCCL through its FIFO, and in place between
    # registered buffers (what (c) uses on a zero-copy communicator; on NVLink they differ by a few %)
    a_reg = w.registered_ceiling(conn, rank, comm, num_bytes, WARMUP + iters)
    a_reg = a_reg[WARMUP:] if a_reg is not None else None
    # for reference, not the goal's ceiling: what two communicators move at once (as (c)'s lanes do)
    a_two = w.two_lane_ceiling(conn, rank, comms, num_bytes, WARMUP + iters)
    a_two = a_two[WARMUP:] if a_two is not None else None
    a = a_plain  # rank 1 records no times
    if rank == 0 and a_reg is not None and w.median_ms(a_reg) < w.median_ms(a_plain):
        a = a_reg
    b = w.reference(conn, rank, comm, cache, ids, WARMUP + iters)[WARMUP:]
    if rank == 1:
        w.poison(cache, ids)
    w.reference(conn, rank, comm, cache, ids, 1)
    b_ok = w.verify(conn, rank, comm, cache, ids)
    # (c) the serving path: P's and D's worker connectors over their agents' NCCL planes
    served = run_transfers(conn, serving, tokens, iters, warmup=WARMUP)
    # (p) the plane driven directly by the benchmark's own sender (diagnostic, decisions 064-067)
    paged = PagedLayers(cache, w.LAYOUT)
    c = w.kvwire_path(conn, side, paged, ids, WARMUP + iters)[WARMUP:]
    handoff = sorted(side.handoff_us[-iters:])
    trace = side.trace(conn, len(side.groups(shape.layers, shape.layer_bytes(tokens))))
    if rank == 1:
        w.poison(cache, ids)
    w.kvwire_path(conn, side, paged, ids, 1)
    c_ok = w.verify(conn, rank, comm, cache, ids)
    if profile:  # untimed: PROFILED more iterations of (a) and of (c), one trace each per rank
        with h.profiled(profile, f"a-{tokens}", rank):
            host = w.ceiling(conn, rank, comm, num_bytes, PROFILED)
        h.save_host_samples(profile, f"a-{tokens}", rank, host)
        with h.profiled(profile, f"c-{tokens}", rank):
            host = w.kvwire_path(conn, side, paged, ids, PROFILED)
        h.save_host_samples(profile, f"c-{tokens}", rank, host)
    if rank == 1:
        return {}
    sa, sb, sp = (w.summarize(x, num_bytes) for x in (a, b, c))
    sc = w.summarize(served["samples_s"], served["bytes"])
    return {
        "tokens": tokens,
        "bytes": num_bytes,
        "ceiling": sa,
        "ceiling_unregistered_gbps": w.summarize(a_plain, num_bytes)["gbps"],
        "ceiling_registered_gbps": w.summarize(a_reg, num_bytes)["gbps"] if a_reg else None,
        "ceiling_two_lanes_gbps": w.summarize(a_two, num_bytes)["gbps"] if a_two else None,
        "reference": sb,
        "kvwire": sc,  # the serving path (connectors + agents)
        "plane": sp,  # the plane under the benchmark's own sender
        "plane_gbps": sp["gbps"],
        "plane_ratio": round(sp["gbps"] / sa["gbps"], 3),
        "serving_bytes": served["bytes"],
        "gbps": sc["gbps"],
        "ceiling_gbps": sa["gbps"],
        "reference_gbps": sb["gbps"],
        "ratio": round(sc["gbps"] / sa["gbps"], 3),
        "speedup_vs_reference": round(sc["gbps"] / sb["gbps"], 2),
        # (c): host time of the sender's t0 step (fire() or the hand-over), median us
        "kvwire_handoff_us": round(handoff[len(handoff) // 2], 1) if handoff else None,
        "verified": b_ok and c_ok and served["verified"],
        "reference_verified": b_ok,
        "kvwire_verified": served["verified"],
        "plane_verified": c_ok,
        # (side, seq, MiB, launch start, launched, completion seen: us after t0, launch CPU us, step marks)
        "kvwire_trace": trace,
    }


def _sweep(
    conn: Connection,
    rank: int,
    cache: list[torch.Tensor],
    shape: w.KVShape,
    opts: dict[str, Any],
    ceilings: dict[int, float],
) -> list[dict[str, Any]]:
    rows = []
    for number, (chunk_mib, edge_mib, *more) in enumerate(opts["sweep"]):
        base = NcclPlaneConfig.from_env()
        cfg = dataclasses.replace(
            base,
            chunk_bytes=chunk_mib * MiB,
            edge_bytes=edge_mib * MiB,
            max_ctas=opts["max_ctas"],
            lanes=more[0] if more else base.lanes,
            ramp=more[1] if len(more) > 1 else base.ramp,
        )
        side = w.KvwireSide(rank, cfg, f"sweep{number}", opts["sender"])
        for tokens in [t for t in opts["tokens"] if t <= 2048]:
            ids = w.block_ids(shape, tokens, cache[0].device, seed=1000 * tokens + rank)
            samples = w.kvwire_path(conn, side, PagedLayers(cache, w.LAYOUT), ids, WARMUP + 10)[WARMUP:]
            if rank == 0:
                num_bytes = shape.layers * shape.layer_bytes(tokens)
                row = {"chunk_mib": chunk_mib, "edge_mib": edge_mib, "tokens": tokens}
                row.update(lanes=cfg.lanes, ramp=cfg.ramp)
                row.update(w.summarize(samples, num_bytes))
                row["ratio"] = round(row["gbps"] / ceilings[tokens], 3)
                rows.append(row)
        side.close()
    return rows


def run_rank(rank: int, conn: Connection, opts: dict[str, Any]) -> dict[str, Any]:
    h.set_safe_env()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    shape = w.KVShape(cache_blocks=max(1200, 2 * w.KVShape().blocks(max(opts["tokens"]))))
    cache = w.make_cache(shape, device, seed=rank + 1)
    comm = h.raw_comm(conn, rank)
    second = h.raw_comm(conn, rank)  # for the two-communicator reference
    defaults = NcclPlaneConfig.from_env()
    chunk = opts["chunk_mib"] * MiB if opts["chunk_mib"] else defaults.chunk_bytes
    edge = opts["edge_mib"] * MiB if opts["edge_mib"] is not None else defaults.edge_bytes
    plane_cfg = dataclasses.replace(defaults, chunk_bytes=chunk, edge_bytes=edge, max_ctas=opts["max_ctas"])
    side = w.KvwireSide(rank, plane_cfg, "main", opts["sender"])
    serving = ServingSide(
        rank,
        KVGeometry(num_blocks=shape.cache_blocks),
        TransferConfig(
            backend=Backend.NCCL,
            transport=Transport.NCCL,
            device=f"cuda:{rank}",
            nccl=plane_cfg,
            default_deadline_s=120.0,
        ),
    )
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "nccl": ".".join(map(str, load_nccl().version())),
        "torch": torch.__version__,
        "chunk_mib": plane_cfg.chunk_bytes // MiB,
        "edge_mib": plane_cfg.edge_bytes // MiB,
        "sender": opts["sender"],
        "ramp": plane_cfg.ramp,
        "send_graphs": plane_cfg.send_graphs,
        "zero_copy": plane_cfg.zero_copy,
        "lanes": plane_cfg.lanes,
        "max_ctas": opts["max_ctas"],
        "iters": opts["iters"],
        "sizes": [],
    }
    for tokens in opts["tokens"]:
        report["sizes"].append(
            _size_row(
                conn,
                rank,
                [comm, second],
                serving,
                side,
                cache,
                shape,
                tokens,
                opts["iters"],
                opts.get("profile"),
            )
        )
    serving.close()
    ceilings = {row["tokens"]: row["ceiling_gbps"] for row in report["sizes"] if row}
    report["send_graph_stats"] = side.plane.send_graph_stats()  # rank 0's are the sender's
    if opts.get("sizes_only"):
        side.close()
        w.barrier(conn, rank)
        abort_all([comm, second])
        return report
    report["overlap"] = extras.overlap(
        conn,
        side,
        cache,
        w.block_ids(shape, opts["overlap_tokens"], device, 7 + rank),
        opts["overlap_tokens"],
        5,
    )
    side.close()
    report["chunk_sweep"] = _sweep(conn, rank, cache, shape, opts, ceilings)
    report["comm_memory"] = extras.comm_memory(conn, rank, [None, 2, 8, 32], 256 * MiB)
    w.barrier(conn, rank)
    if rank == 0:
        report["gather_scatter"] = [
            extras.gather_scatter(cache, w.block_ids(shape, t, device, 11), t) for t in opts["tokens"]
        ]
    w.barrier(conn, rank)
    abort_all([comm, second])
    return report
