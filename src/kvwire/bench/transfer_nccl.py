"""``kvwire bench transfer --backend nccl``: KV transfer between two GPUs, side by side in one run.

Per size (Llama-3-8B-shaped paged KV, bf16, block size 16, random block ids on both sides):

* (a) ``ceiling``: one contiguous NCCL send of the same bytes, measured both through NCCL's FIFO
  and between registered buffers (in place, as (c) moves a zero-copy communicator's messages); the
  faster of the two is the ceiling;
* (b) ``reference``: the seed's per-layer way (gather one layer, one control round trip, one send,
  one sync, scatter) over the same communicator;
* (c) ``kvwire``: **the serving path** (:mod:`kvwire.bench.serving_path`): P's and D's worker
  connectors over their agents' NCCL planes, exactly as an instance runs them — D binds the receive
  of its blocks, P saves each layer (``save_kv_layer``), the agent hands the plane block ids, the
  plane gathers each message from the paged cache into a zero-copy slab and D's stream scatters each
  layer into its blocks (decision 068). The goals are (c)/(a).
* (p) ``plane``: diagnostic, the plane driven by the benchmark's own sender (decisions 064-067). By
  default (``--sender armed``) the sender hands every layer over *before* t0 with a device producer and a
  device signal (:mod:`kvwire.transfer.planes.nccl.device_signal`): the plane queues the transfer
  on its send stream behind a wait for the signal (one CUDA graph replay once the shape repeats),
  and at t0 the sender's stream fires it, as a P instance would right after its forward wrote the
  KV. The plane gathers each message with one launch (:mod:`kvwire.transfer.planes.common.group_kernels`)
  right before sending it; the receiver
  posts every message before the data is ready and scatters each on arrival (device consumers).
  ``--sender producer`` hands the layers over at t0 instead.

Plus: chunk-size sweep, layer-wise overlap with a synthetic forward pass, GPU memory per communicator
by channel bound, and one-launch vs per-layer gather/scatter. Needs two CUDA GPUs; run as
``kvwire bench transfer --backend nccl [--tokens 512 2048 8192] [--json] [--out FILE]`` (or
``python -m kvwire.bench.transfer_nccl``).
"""

from __future__ import annotations

import argparse
import builtins
import datetime
import faulthandler
import json
import multiprocessing as mp
import os
import queue as queue_module
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

DEFAULT_TOKENS = [512, 2048, 8192]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="nccl", choices=["nccl"])
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--iters", type=int, default=15, help="timed iterations per method and size")
    parser.add_argument(
        "--chunk-mib", type=int, default=None, help="NCCL plane message bound (default: plane's)"
    )
    parser.add_argument(
        "--edge-mib", type=int, default=None, help="first/last message size (default: plane's)"
    )
    parser.add_argument(
        "--sweep",
        nargs="*",
        default=["192:8:1:6", "64:8", "128:8", "96:0"],
        help="extra CHUNK_MIB:EDGE_MIB[:LANES[:RAMP]] framings to measure at <= 2048 tokens (lanes and"
        " ramp default to the plane's; 192:8:1:6 is the one-lane framing before lanes)",
    )
    parser.add_argument("--max-ctas", type=int, default=None, help="NCCL channel bound (None = default)")
    parser.add_argument("--overlap-tokens", type=int, default=2048)
    parser.add_argument("--sizes-only", action="store_true", help="only (a)/(b)/(c) per size: no extras")
    parser.add_argument(
        "--sender",
        choices=["armed", "producer", "per-message", "bulk"],
        default="armed",
        help="(c): 'armed' (default): the whole transfer is handed over before t0 behind a device signal "
        "that the sender's stream fires at t0 (what a P instance does: it knows the blocks before its "
        "forward ends); 'producer': handed over at t0 with a device producer per message; "
        "'per-message'/'bulk': the caller gathers and hands each message / everything over",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after the timed runs, trace 2 more (a) and (c) iterations per size with torch.profiler "
        "into DIR (one Chrome trace per iteration and rank; print with benchmarks/timeline.py)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", default=None, help="also write the JSON results to this file")
    parser.add_argument("--timeout-s", type=float, default=540.0)


def _sizes(args: argparse.Namespace) -> list[int]:
    tokens = getattr(args, "tokens", None) or DEFAULT_TOKENS
    return [tokens] if isinstance(tokens, int) else list(tokens)


def _worker(rank: int, conn: Connection, opts: dict[str, Any], queue: Any) -> None:
    # the parent asks for every thread's stack (SIGUSR1) when the other rank failed or time ran out
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        from kvwire.bench.nccl_run import run_rank

        result = run_rank(rank, conn, opts)
        queue.put((rank, result, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def _dump_stacks(procs: list[Any]) -> None:
    """Ask live workers to print every thread's stack (to the shared stderr) before they are killed."""
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            print(f"stacks of worker pid {proc.pid}:", file=sys.stderr, flush=True)
            os.kill(proc.pid, signal.SIGUSR1)
            proc.join(timeout=2.0)  # bounded: lets it write the dump


def run(args: argparse.Namespace) -> int:
    import torch

    if torch.cuda.device_count() < 2:
        print("kvwire bench transfer --backend nccl needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    from kvwire.bench.nccl_harness import set_safe_env

    set_safe_env()
    opts = {
        "tokens": _sizes(args),
        "iters": getattr(args, "iters", 15),
        "chunk_mib": getattr(args, "chunk_mib", None),
        "edge_mib": getattr(args, "edge_mib", None),
        "sweep": [_framing(spec) for spec in getattr(args, "sweep", [])],
        "max_ctas": getattr(args, "max_ctas", None),
        "overlap_tokens": getattr(args, "overlap_tokens", 2048),
        "sizes_only": getattr(args, "sizes_only", False),
        "sender": getattr(args, "sender", "armed"),
        "profile": getattr(args, "profile", None),
    }
    ctx = mp.get_context("spawn")
    left, right = ctx.Pipe()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(rank, conn, opts, queue), daemon=True)
        for rank, conn in ((0, left), (1, right))
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    timeout_s = getattr(args, "timeout_s", 540.0)
    try:
        for _ in procs:
            try:
                rank, result, error = queue.get(timeout=timeout_s)
            except queue_module.Empty:
                print(f"kvwire bench transfer --backend nccl: no result in {timeout_s} s", file=sys.stderr)
                _dump_stacks(procs)
                return 1
            if error:
                print(f"rank {rank} failed:\n{error}", file=sys.stderr)
                _dump_stacks(procs)
                return 1
            results[rank] = result
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    report = results[0]
    report["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    as_json = getattr(args, "json", False)
    print_table(report, sys.stderr if as_json else sys.stdout)
    if as_json:  # one JSON object on stdout, like the TCP benchmark; the table goes to stderr
        print(json.dumps(report))
    if getattr(args, "out", None):
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


def _framing(spec: str) -> tuple[int, ...]:
    """``CHUNK_MIB:EDGE_MIB[:LANES[:RAMP]]`` of ``--sweep``."""
    values = tuple(int(v) for v in spec.split(":"))
    if not 2 <= len(values) <= 4:
        raise SystemExit(f"--sweep {spec!r}: expected CHUNK_MIB:EDGE_MIB[:LANES[:RAMP]]")
    return values


def print_table(report: dict[str, Any], out: Any = None) -> None:
    def print(*parts: object) -> None:  # the table's own printer (to ``out``)
        builtins.print(*parts, file=out or sys.stdout)

    print(f"\nNCCL KV transfer, {report['gpu']} x2, NCCL {report['nccl']}, torch {report['torch']}")
    head = ["tokens", "MiB", "(a) ceil", "(b) ref", "(c) serve", "c/a", "c/b", "(p) plane", "p/a"]
    print(" ".join(f"{name:>9}" for name in head), "verified")
    for row in report["sizes"]:
        print(
            f"{row['tokens']:>9} {row['bytes'] / 2**20:>9.0f} {row['ceiling_gbps']:>9.1f} "
            f"{row['reference_gbps']:>9.1f} {row['gbps']:>9.1f} {row['ratio']:>9.2f} "
            f"{row['speedup_vs_reference']:>9.2f} {row.get('plane_gbps', 0):>9.1f} "
            f"{row.get('plane_ratio', 0):>9.2f} {row['verified']}"
        )
    print("(c): the serving path (P/D connectors + agents); (p): the plane under the bench's own sender")
    print("(GB/s; ms in the JSON)")
    ceilings = [
        f"{row['tokens']}: {row.get('ceiling_unregistered_gbps')} / {row.get('ceiling_registered_gbps')}"
        for row in report["sizes"]
    ]
    print(f"(a) unregistered / registered buffers, GB/s (the faster is the ceiling): {', '.join(ceilings)}")
    two = [f"{row['tokens']}: {row.get('ceiling_two_lanes_gbps')}" for row in report["sizes"]]
    print(f"for reference, the same bytes as two halves sent at once on two communicators: {', '.join(two)}")
    handoffs = [f"{row['tokens']}: {row.get('kvwire_handoff_us')}" for row in report["sizes"]]
    print(f"(p) sender's t0 step on the host (fire or hand-over), median us: {', '.join(handoffs)}")
    for row in report["sizes"]:
        legend = "(side, seq, MiB, launch start, launched, done: us after t0; launch CPU us; step marks)"
        print(f"chunks of the last (c) at {row['tokens']} tokens {legend}:")
        for chunk in row.get("kvwire_trace", []):
            print("   ", tuple(chunk))
    print(
        f"framing: messages of <= {report['chunk_mib']} MiB, first/last {report['edge_mib']} MiB, "
        f"ramp {report.get('ramp')}, lanes {report.get('lanes')}, zero-copy {report.get('zero_copy')}; "
        f"sender {report.get('sender')}; "
        f"send graphs {report.get('send_graph_stats')}"
    )
    for row in report.get("chunk_sweep", []):
        print(
            f"chunk {row['chunk_mib']:>3} MiB edge {row['edge_mib']:>3} MiB lanes {row.get('lanes')} "
            f"ramp {row.get('ramp')}  tokens {row['tokens']:>5}: {row['gbps']:>6.1f} GB/s "
            f"ratio {row['ratio']:.2f}"
        )
    ov = report.get("overlap")
    if ov:
        exposed = ov["exposed_ms"]
        tail = f"{exposed} ms after the forward" if exposed > 0 else f"none ({-exposed} ms before its end)"
        print(
            f"overlap @{ov['tokens']} tokens: layer compute {ov['layer_compute_ms']} ms, KV in flight "
            f"after the forward: {tail}; forward {ov['forward_ms']} -> {ov['forward_with_transfer_ms']} "
            f"ms while sending; goal met: {ov['goal_met']}"
        )
    for row in report.get("comm_memory", []):
        print(f"comm max_ctas={row['max_ctas']}: {row['comm_gpu_mib']} MiB GPU, {row['gbps']} GB/s @256 MiB")
    for row in report.get("gather_scatter", []):
        print(
            f"gather @{row['tokens']}: one launch {row['gather_one_launch_ms']} ms vs per layer "
            f"{row['gather_per_layer_ms']} ms; scatter {row['scatter_one_launch_ms']} vs "
            f"{row['scatter_per_layer_ms']} ms; exact={row['bit_exact']} triton={row['triton']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
