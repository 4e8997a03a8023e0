"""``kvwire up --ray ADDRESS`` and ``kvwire scale``: a kvwire cluster on a Ray cluster (decision 120).

``kvwire up --ray auto --prefill 1 --decode 2 --prefill-resources pool_p=1 --decode-resources pool_d=1``
places the router and instances as Ray actors, prints the router URL, and runs until Ctrl-C/SIGTERM,
which stops every process. ``kvwire scale --ray auto [--name NAME] --decode 3`` changes the count of a
role of that running cluster (new instances registered, removed ones drained). Ray is imported only
here, inside the commands (``pip install 'kvwire[ray]'``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from kvwire.cluster.cli import _interrupt, spec_from_args, stop_shielded
from kvwire.cluster.ray_spec import Placement, RaySpec, parse_labels, parse_resources
from kvwire.errors import ClusterError, ConfigError
from kvwire.protocol.kv_params import Role

STATUS_EVERY_S = 5.0  # how often `up` checks that the controller still answers


def _placement(args: argparse.Namespace, role: str, tp: int) -> Placement:
    gpus = args.gpus_per_rank if args.gpus_per_rank is not None else float(args.device.startswith("cuda"))
    cpus = args.cpus_per_rank
    if role == "router":
        gpus, cpus = 0.0, 1.0
    return Placement(tp=tp, cpus_per_rank=cpus, gpus_per_rank=gpus,
                     resources=parse_resources(getattr(args, f"{role}_resources")),
                     labels=parse_labels(getattr(args, f"{role}_labels")))


def ray_spec_from_args(args: argparse.Namespace) -> RaySpec:
    cluster = spec_from_args(args)
    return RaySpec(
        cluster, address=args.ray, name=args.name,
        prefill=_placement(args, "prefill", cluster.prefill_tp),
        decode=_placement(args, "decode", cluster.decode_tp),
        router=_placement(args, "router", 1), max_restarts=args.max_restarts,
        drain_timeout_s=args.drain_timeout_s,
    )


def _describe(state: dict[str, Any]) -> str:
    parts = [f"{name} on {p.get('ip')} (node {str(p.get('node_id', ''))[:8]})"
             for name, p in sorted(state.get("processes", {}).items())]
    return ", ".join(parts)


def _alive(state: dict[str, Any]) -> dict[str, int | None]:
    """Process name -> the pid of its kvwire child, None while it is down."""
    return {name: p.get("pid") if p.get("alive") else None for name, p in state.get("processes", {}).items()}


def _changes(before: dict[str, int | None], now: dict[str, int | None]) -> list[str]:
    """One line per process (name -> pid, None while down) whose state changed."""
    lines = []
    for name in sorted(set(before) | set(now)):
        if name not in now:
            lines.append(f"{name} removed")
        elif now[name] is None and before.get(name) is not None:
            lines.append(f"{name} down (Ray restarts it)")
        elif name not in before:
            lines.append(f"{name} added")
        elif now[name] is not None and before[name] != now[name]:
            lines.append(f"{name} restarted (pid {now[name]})")
    return lines


def run_up(args: argparse.Namespace) -> int:
    try:
        spec = ray_spec_from_args(args)
        from kvwire.cluster.ray_cluster import RayCluster
    except ConfigError as exc:
        print(f"kvwire up: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(f"kvwire up --ray: {exc}; install it with pip install 'kvwire[ray]'", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    cluster = RayCluster(spec)
    try:
        cluster.start()
        print(f"kvwire up: router {cluster.router_url} ({_describe(cluster.state)}) on Ray; "
              f"Ctrl-C stops everything", flush=True)
        alive = _alive(cluster.state)
        while True:
            time.sleep(STATUS_EVERY_S)
            now = _alive(cluster.status())  # raises when the controller is gone
            for line in _changes(alive, now):
                print(f"kvwire up: {line}", flush=True)
            alive = now
    except KeyboardInterrupt:
        print("kvwire up: stopping", flush=True)
        return 0
    except Exception as exc:  # ClusterError, or a Ray error: the controller died
        print(f"kvwire up: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_shielded(cluster.stop)


# --- kvwire scale ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray", metavar="ADDRESS|auto", default="auto", help="the Ray cluster")
    parser.add_argument("--name", default="default", help="the kvwire cluster's name (kvwire up --name)")
    for role in Role:
        parser.add_argument(f"--{role.value}", type=int, default=None, metavar="N",
                            help=f"bring {role.value} instances to N")
    parser.add_argument("--status", action="store_true", help="only print the cluster's processes (JSON)")


def run(args: argparse.Namespace) -> int:
    wanted = [(role, getattr(args, role.value)) for role in Role if getattr(args, role.value) is not None]
    if not wanted and not args.status:
        print("kvwire scale: give --prefill N, --decode N or --both N (or --status)", file=sys.stderr)
        return 2
    try:
        from kvwire.cluster.ray_cluster import RayCluster

        cluster = RayCluster.attach(args.name, args.ray)
    except ModuleNotFoundError as exc:
        print(f"kvwire scale: {exc}; install it with pip install 'kvwire[ray]'", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"kvwire scale: {exc}", file=sys.stderr)
        return 1
    try:
        for role, count in wanted:
            cluster.scale(role, count)
        print(json.dumps(cluster.status(), indent=2, sort_keys=True))
        return 0
    except (ClusterError, ConfigError) as exc:
        print(f"kvwire scale: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.close()
