"""``kvwire up``: a local router + prefill/decode cluster as subprocesses, until Ctrl-C/SIGTERM.
With ``--ray ADDRESS`` the same cluster runs as Ray actors across a Ray cluster (kvwire.cluster.ray_cli).

Example: ``kvwire up --prefill 1 --decode 1 --model tiny --device cpu --mode push --port 8000``.
Every child's output is prefixed with its name; the router URL is printed once everything is healthy.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.errors import ClusterError, ConfigError
from kvwire.http.front_door import API_KEY_ENV
from kvwire.protocol.kv_params import LoadFailurePolicy, TransferMode
from kvwire.secrets_config import add_secret_arguments, check_exposure, generate_secret, load_secret
from kvwire.transfer.enums import Transport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="prefill instances (default %(default)s)")
    parser.add_argument("--decode", type=int, default=1, help="decode instances (default %(default)s)")
    parser.add_argument("--both", type=int, default=0, help="colocated instances (default %(default)s)")
    parser.add_argument("--model", default="tiny",
                        help="model name (tiny, smollm2-135m, ...), .gguf file or HF directory")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (every instance)")
    parser.add_argument("--mode", choices=[m.value for m in TransferMode], default=TransferMode.PUSH.value)
    parser.add_argument("--host", default="127.0.0.1", help="address everything binds to")
    parser.add_argument(
        "--port", type=int, default=8000, help="router HTTP port, 0 = any (default %(default)s)"
    )
    parser.add_argument("--kv-deadline-s", type=float, default=30.0, help="KV deadline / lease")
    parser.add_argument("--kv-transport", choices=[t.value for t in Transport], default=Transport.AUTO.value,
                        help="KV data plane of every instance: auto (negotiated per peer) or forced")
    parser.add_argument("--kv-load-failure-policy", choices=[p.value for p in LoadFailurePolicy],
                        default=LoadFailurePolicy.RECOMPUTE.value,
                        help="what decode instances do when remote KV cannot be loaded (default %(default)s)")
    parser.add_argument("--discovery", default="zmq", metavar="zmq|etcd|etcd[+https]://HOST:PORT[/prefix]",
                        help="zmq: the router's heartbeats (default); etcd: start a local etcd (binary "
                             "needed) for instances and router; etcd://...: use a running etcd")
    parser.add_argument("--start-timeout-s", type=float, default=180.0, help="deadline for all to be healthy")
    parser.add_argument("--stop-grace-s", type=float, default=10.0, help="SIGTERM->SIGKILL grace")
    parser.add_argument("--spread-gpus", type=int, default=0, metavar="N",
                        help="give instance k only GPU k %% N (CUDA_VISIBLE_DEVICES); 0 = leave as is")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="API key clients must send to the router; the router sends it to the "
                             "instances too (default: $KVWIRE_API_KEY, else none)")
    parser.add_argument("--prefill-tp", type=int, default=1,
                        help="tensor-parallel size of each prefill (and colocated) instance")
    parser.add_argument("--decode-tp", type=int, default=1,
                        help="tensor-parallel size of each decode instance")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                        help="extra `kvwire serve` flag (repeat; e.g. --serve-arg=--num-kv-blocks=512)")
    # The cluster's secret: --secret-file or $KVWIRE_SECRET, else a fresh one per cluster (decision 124),
    # handed to the children in their environment.
    add_secret_arguments(parser)
    add_ray_arguments(parser)


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvwire up --ray``: the same cluster as Ray actors across a Ray cluster's nodes (decision 120)."""
    ray = parser.add_argument_group("on a Ray cluster (pip install 'kvwire[ray]')")
    ray.add_argument("--ray", metavar="ADDRESS|auto", default=None,
                     help="place the router and instances as actors on this Ray cluster (auto: the one "
                          "`ray start` runs on this node); --host is then each node's IP")
    ray.add_argument("--name", default="default", help="the cluster's name on Ray (kvwire scale --name)")
    for role in ("prefill", "decode", "router"):
        ray.add_argument(f"--{role}-resources", default="", metavar="NAME=AMOUNT[,...]",
                         help=f"custom Ray resources each {role} reserves (e.g. pool_{role[0]}=1)")
        ray.add_argument(f"--{role}-labels", default="", metavar="KEY=VALUE[,...]",
                         help=f"node labels a {role} node must have")
    ray.add_argument("--cpus-per-rank", type=float, default=1.0, help="Ray CPUs per TP rank (default 1)")
    ray.add_argument("--gpus-per-rank", type=float, default=None,
                     help="Ray GPUs per TP rank (default: 1 with --device cuda, else 0)")
    ray.add_argument("--max-restarts", type=int, default=20,
                     help="restarts Ray makes of an instance whose process died (-1: no limit)")
    ray.add_argument("--drain-timeout-s", type=float, default=60.0,
                     help="a removed instance's requests in flight may finish for this long")


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    secret = load_secret(args.secret_file) or generate_secret()
    check_exposure("kvwire up", args.host, [], secret=True, api_key=bool(args.api_key),
                   insecure=args.insecure)
    insecure = ("--insecure",) if args.insecure else ()
    return ClusterSpec(
        num_prefill=args.prefill, num_decode=args.decode, num_both=args.both, model=args.model,
        device=args.device, mode=TransferMode(args.mode), host=args.host, port=args.port,
        kv_deadline_s=args.kv_deadline_s, kv_transport=Transport(args.kv_transport),
        kv_load_failure_policy=LoadFailurePolicy(args.kv_load_failure_policy),
        start_timeout_s=args.start_timeout_s, stop_grace_s=args.stop_grace_s,
        serve_args=(*args.serve_arg, *insecure), spread_gpus=args.spread_gpus, api_key=args.api_key,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
        discovery=args.discovery, secret=secret, router_args=insecure,
    )


def stop_shielded(stop: Callable[[], object]) -> None:
    """Run a cluster's ``stop`` with SIGINT and SIGTERM ignored: a second Ctrl-C or a SIGTERM during
    the clean-up must not cut it short (orphans). The default handlers are back afterwards."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        stop()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """First Ctrl-C or SIGTERM: stop the cluster. Later ones are ignored from here on, so they cannot
    cut the clean-up short and leave orphan processes."""
    del signum, frame
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.ray is not None:
        from kvwire.cluster.ray_cli import run_up

        return run_up(args)
    try:
        spec = spec_from_args(args)
    except ConfigError as exc:
        print(f"kvwire up: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the cluster like Ctrl-C does
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        names = ", ".join(f"{i.name} {i.url}" for i in cluster.instances.values())
        print(f"kvwire up: router {cluster.router_url} ({names}); Ctrl-C stops everything", flush=True)
        while True:
            time.sleep(0.5)
            dead = cluster.check()
            if dead is not None and cluster.restart_if_rank_lost(dead):
                print(f"kvwire up: {dead} lost a tensor-parallel rank; restarted", file=sys.stderr)
                continue
            if dead is not None:
                print(f"kvwire up: {dead} exited unexpectedly; stopping the cluster", file=sys.stderr)
                return 1
    except ClusterError as exc:
        print(f"kvwire up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvwire up: stopping", flush=True)
        return 0
    finally:
        stop_shielded(cluster.stop)
