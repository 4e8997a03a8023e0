"""ClusterSpec and LocalCluster keep modes, roles and policies as enums: strings are converted once at
construction, bad values are a ConfigError naming the valid ones, child processes get the values."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvwire.cluster import local
from kvwire.cluster.cli import add_arguments, spec_from_args
from kvwire.cluster.local import ClusterSpec, LocalCluster
from kvwire.connector.config import LoadFailurePolicy
from kvwire.enum_values import as_enum
from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import Role, TransferMode


def test_enum_fields_default_to_members() -> None:
    spec = ClusterSpec()
    assert spec.mode is TransferMode.PUSH
    assert spec.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE


def test_string_values_become_members() -> None:
    spec = ClusterSpec(mode="pull", kv_load_failure_policy="fail")  # type: ignore[arg-type]
    assert spec.mode is TransferMode.PULL
    assert spec.kv_load_failure_policy is LoadFailurePolicy.FAIL
    assert spec == ClusterSpec(mode=TransferMode.PULL, kv_load_failure_policy=LoadFailurePolicy.FAIL)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mode", "sideways", "mode must be one of push, pull; got 'sideways'"),
    ("mode", None, "mode must be one of push, pull; got None"),
    ("kv_load_failure_policy", "maybe", "kv_load_failure_policy must be one of recompute, fail; got 'maybe'"),
    ("kv_load_failure_policy", TransferMode.PUSH, "kv_load_failure_policy must be one of recompute, fail"),
    ("kv_load_failure_policy", ["fail"], "kv_load_failure_policy must be one of recompute, fail"),
])
def test_bad_values_are_a_clear_config_error(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClusterSpec(**{field: value})
    assert str(info.value).startswith(message)


def test_as_enum() -> None:
    assert as_enum(Role, "decode", "role") is Role.DECODE
    assert as_enum(Role, Role.BOTH, "role") is Role.BOTH
    with pytest.raises(ConfigError, match="role must be one of prefill, decode, both; got 'router'"):
        as_enum(Role, "router", "role")


def _up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_up_accepts_the_same_strings() -> None:
    assert spec_from_args(_up_args()).kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE
    spec = spec_from_args(_up_args("--mode", "pull", "--kv-load-failure-policy", "fail"))
    assert (spec.mode, spec.kv_load_failure_policy) == (TransferMode.PULL, LoadFailurePolicy.FAIL)


def test_up_rejects_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _up_args("--kv-load-failure-policy", "maybe")
    assert "invalid choice: 'maybe'" in capsys.readouterr().err


class _FakeProcess:
    """Stands in for ManagedProcess: records the argv instead of starting anything."""

    started: list[list[str]] = []

    def __init__(self, name: str, argv: list[str], **kwargs: Any) -> None:
        self.name = name
        self.argv = argv
        _FakeProcess.started.append(argv)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_instances_get_the_values_on_their_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "ManagedProcess", _FakeProcess)
    _FakeProcess.started = []
    cluster = LocalCluster(ClusterSpec(mode=TransferMode.PULL, kv_load_failure_policy=LoadFailurePolicy.FAIL))
    instance = cluster.start_instance("decode-7", Role.DECODE)
    again = cluster.start_instance("prefill-7", "prefill")  # type: ignore[arg-type]  # by value
    assert (instance.role, again.role) == (Role.DECODE, Role.PREFILL)
    d_argv, p_argv = _FakeProcess.started
    assert _flag(d_argv, "--role") == "decode" and _flag(p_argv, "--role") == "prefill"
    assert _flag(d_argv, "--kv-mode") == "pull"
    assert _flag(d_argv, "--kv-load-failure-policy") == "fail"


def test_unknown_role_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "ManagedProcess", _FakeProcess)
    _FakeProcess.started = []
    cluster = LocalCluster(ClusterSpec())
    with pytest.raises(ConfigError, match="role must be one of prefill, decode, both"):
        cluster.start_instance("router-0", "router")  # type: ignore[arg-type]
    assert cluster.instances == {} and _FakeProcess.started == []


def test_prefill_and_decode_get_their_tensor_parallel_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "ManagedProcess", _FakeProcess)
    _FakeProcess.started = []
    spec = spec_from_args(_up_args("--prefill-tp", "2", "--decode-tp", "4"))
    assert (spec.prefill_tp, spec.decode_tp) == (2, 4)
    cluster = LocalCluster(spec)
    cluster.start_instance("prefill-0", Role.PREFILL)
    cluster.start_instance("decode-0", Role.DECODE)
    p_argv, d_argv = _FakeProcess.started
    assert _flag(p_argv, "--tensor-parallel-size") == "2" and _flag(d_argv, "--tensor-parallel-size") == "4"
    with pytest.raises(ConfigError, match="decode_tp"):
        ClusterSpec(decode_tp=0)


@pytest.mark.parametrize(("extra", "share"), [
    ({"device": "cuda", "num_decode": 1}, "0.4500"),  # 1P1D on one GPU: 0.9 split in two
    ({"device": "cuda", "num_decode": 2}, "0.3000"),
    ({"device": "cuda", "num_decode": 3, "spread_gpus": 2}, "0.4500"),  # 4 instances on 2 GPUs
    ({"device": "cuda", "num_decode": 1, "spread_gpus": 2}, None),  # one GPU each: sized from what is free
    ({"device": "cpu", "num_decode": 1}, None),
])
def test_instances_sharing_a_gpu_get_a_share_of_it(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], share: str | None
) -> None:
    """The first instance started on a shared GPU must not size its KV cache into the memory the
    next one needs for its weights (an 8B 1P1D on one 80 GiB H100 ran out of memory, 2026-12-05)."""
    monkeypatch.setattr(local, "ManagedProcess", _FakeProcess)
    _FakeProcess.started = []
    cluster = LocalCluster(ClusterSpec(num_prefill=1, **extra))
    cluster.start_instance("prefill-0", Role.PREFILL)
    (argv,) = _FakeProcess.started
    if share is None:
        assert "--gpu-memory-utilization" not in argv
    else:
        assert _flag(argv, "--gpu-memory-utilization") == share


def test_a_serve_flag_overrides_the_gpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "ManagedProcess", _FakeProcess)
    _FakeProcess.started = []
    spec = ClusterSpec(device="cuda", serve_args=("--gpu-memory-utilization", "0.7"))
    LocalCluster(spec).start_instance("decode-0", Role.DECODE)
    (argv,) = _FakeProcess.started
    last = len(argv) - 1 - argv[::-1].index("--gpu-memory-utilization")
    assert argv[last + 1] == "0.7"  # argparse keeps the last value
