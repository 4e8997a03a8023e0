"""``kvwire up --ray`` without a Ray cluster: flags -> RaySpec -> placements and the child command lines
(each parsed by the real ``kvwire serve`` / ``kvwire router`` parsers, so they stay valid)."""

from __future__ import annotations

import argparse

import pytest

from kvwire.cli import build_parser
from kvwire.cluster.local import ClusterSpec
from kvwire.cluster.ray_spec import Placement, RaySpec, parse_labels, parse_resources
from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import Role


def up_args(*flags: str) -> argparse.Namespace:
    argv = ["up", "--ray", "auto", *flags]
    return build_parser(argv).parse_args(argv)


def test_flags_become_placements() -> None:
    from kvwire.cluster.ray_cli import ray_spec_from_args

    spec = ray_spec_from_args(up_args(
        "--device", "cuda", "--prefill-tp", "2", "--decode", "3", "--prefill-resources", "pool_p=1,ssd",
        "--decode-labels", "pool=decode", "--router-resources", "head=0.5", "--name", "prod",
    ))
    assert spec.cluster.num_decode == 3 and spec.name == "prod" and spec.controller_name == "kvwire-prod"
    assert spec.prefill.bundle() == {"CPU": 2.0, "GPU": 2.0, "pool_p": 1.0, "ssd": 1.0}  # one TP group
    assert spec.decode.bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert spec.decode.labels == (("pool", "decode"),)
    assert spec.router.bundle() == {"CPU": 1.0, "head": 0.5}  # the router takes no GPU
    assert spec.placement(Role.BOTH) is spec.prefill
    cpu = ray_spec_from_args(up_args())
    assert cpu.decode.bundle() == {"CPU": 1.0} and cpu.decode.actor_options()["num_gpus"] == 0


@pytest.mark.parametrize(("text", "error"), [
    ("pool=x", "must be a number"), ("CPU=2", "other than CPU"), ("pool=-1", "amount > 0"),
])
def test_bad_resources_are_refused(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        Placement(resources=parse_resources(text))


def test_bad_labels_and_specs_are_refused() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_labels("pool")
    with pytest.raises(ConfigError, match="running etcd"):
        RaySpec(ClusterSpec(discovery="etcd"))
    with pytest.raises(ConfigError, match="spread-gpus"):
        RaySpec(ClusterSpec(spread_gpus=2))
    with pytest.raises(ConfigError, match="tp"):
        RaySpec(ClusterSpec(decode_tp=2))  # the decode placement still reserves for tp 1
    with pytest.raises(ConfigError, match="name"):
        RaySpec(ClusterSpec(), name="no spaces")
    with pytest.raises(ConfigError, match="max_restarts"):
        RaySpec(ClusterSpec(), max_restarts=-2)


def test_child_command_lines_parse() -> None:
    pytest.importorskip("ray")
    from kvwire.cluster.ray_controller import ClusterController

    cluster = ClusterSpec(num_decode=2, discovery="etcd://127.0.0.1:2379/kv",
                          router_args=("--policy", "round_robin"))
    spec = RaySpec(cluster, drain_timeout_s=12.0)
    controller = ClusterController(spec, {})
    controller._discovery = spec.cluster.discovery
    serve = [*controller.serve_argv("decode-1", Role.DECODE), "--host", "10.0.0.7"][3:]
    args = build_parser(serve).parse_args(serve)
    assert (args.role, args.instance_id, args.router, args.drain_timeout_s) == (
        "decode", "decode-1", ["etcd://127.0.0.1:2379/kv"], 12.0)
    assert args.port == 0  # fresh ports on every (re)start: the registration tells the router
    router = [*controller.router_argv(8000, 8001), "--host", "10.0.0.7", "--discovery-host", "10.0.0.7"][3:]
    args = build_parser(router).parse_args(router)
    assert (args.port, args.discovery_port, args.discovery, args.policy) == (
        8000, 8001, "etcd://127.0.0.1:2379/kv", "round_robin")


def test_up_reports_state_changes() -> None:
    from kvwire.cluster.ray_cli import _changes

    before = {"router": 10, "decode-0": 11, "decode-1": 12, "prefill-0": 13}
    now = {"router": 10, "decode-0": None, "prefill-0": 20, "prefill-1": 21}
    assert _changes(before, now) == ["decode-0 down (Ray restarts it)", "decode-1 removed",
                                     "prefill-0 restarted (pid 20)", "prefill-1 added"]
    assert _changes(now, now) == []
