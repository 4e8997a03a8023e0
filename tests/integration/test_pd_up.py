"""`kvwire up` as a user runs it: prints the router URL, serves P/D requests, and on SIGTERM stops
every process it started (process groups, grace then kill) — no orphans. Plus the demo and the
bench load generator's statistics."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvwire.bench.serve import _percentiles, summarize
from kvwire.cluster.client import RequestResult
from kvwire.cluster.local import ClusterSpec
from kvwire.cluster.process import ManagedProcess, kvwire_argv
from kvwire.errors import ConfigError
from support.pd_cluster_helpers import body, metric, send_all

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purpose once its parent reaped it.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def _children(pid: int) -> list[int]:
    argv = ["ps", "-o", "pid=", "--ppid", str(pid)]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def _stop_up(proc: subprocess.Popen[str], children: list[int]) -> None:
    """Teardown whatever the test reached: ``kvwire up`` stops its own children on SIGTERM (they run in
    their own sessions, so killing only ``proc`` would orphan them); any child still alive is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for pid in children:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def test_kvwire_up_serves_and_stops_everything_on_ctrl_c_then_sigterm() -> None:
    argv = kvwire_argv("up", "--port", "0", "--prefill", "1", "--decode", "1", "--stop-grace-s", "5")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[int] = []
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("kvwire up: router"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(120), "".join(lines[-30:])
        banner = next(line for line in lines if line.startswith("kvwire up: router"))
        url = re.search(r"router (http://\S+)", banner).group(1)  # type: ignore[union-attr]
        assert any(line.startswith("[prefill-0] ") for line in lines)  # prefixed child output
        children = _children(proc.pid)
        assert len(children) == 3  # router, prefill-0, decode-0
        result = send_all(url, [body([1, 2, 3, 4, 5], stream=True)])[0]
        assert result.ok and len(result.token_ids) == 8
        decode_url = re.search(r"decode-0 (http://[0-9.:]+)", banner).group(1)  # type: ignore[union-attr]
        assert metric(decode_url, "kvwire_pd_transfers_completed_total") == 1  # really P/D
        proc.send_signal(signal.SIGINT)  # Ctrl-C, then an impatient SIGTERM during the clean-up
        deadline = time.monotonic() + 30
        while not any("kvwire up: stopping" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "orphan processes left behind"
    finally:
        _stop_up(proc, children or _children(proc.pid))


def test_managed_process_kills_its_whole_group() -> None:
    # A child that ignores SIGTERM and starts a grandchild: stop() must still leave nothing behind.
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              "print(p.pid, flush=True); time.sleep(600)")
    sink = io.StringIO()
    child = ManagedProcess("stubborn", [sys.executable, "-c", script], sink=sink, sink_lock=threading.Lock())
    try:
        deadline = time.monotonic() + 30
        while not child.lines and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.lines, "the child printed nothing within 30 s"
        grandchild = int(child.lines[0])
        start = time.monotonic()
        child.stop(grace_s=1.0)
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild)
        assert f"[stubborn] {grandchild}" in sink.getvalue()
    finally:
        child.stop(grace_s=1.0)  # idempotent; on a failure above it still takes the whole group down


def test_demo_runs_the_main_job() -> None:
    """The README's command on its default model (smollm2-135m): real answers through 1P1D, and P/D
    equal to a colocated engine token for token on a real model."""
    argv = kvwire_argv("demo", "--max-tokens", "8")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(smollm2-135m on cpu, push)" in out.stdout
    assert "The capital of France is Paris." in out.stdout  # a real model answers
    assert "Q3 (streaming)" in out.stdout and "mean ITL" in out.stdout
    assert 'kvwire_pd_transfers_completed_total{side="recv"} 3.0' in out.stdout
    assert 'kvwire_kv_peers{transport="shm"} 1.0' in out.stdout  # negotiated: P and D share the host
    assert "P/D output == colocated output (greedy, token for token): 3/3 requests" in out.stdout
    assert "cluster stopped" in out.stdout


def test_cluster_spec_is_validated() -> None:
    with pytest.raises(ConfigError):
        ClusterSpec(num_prefill=1, num_decode=0)
    with pytest.raises(ConfigError):
        ClusterSpec(num_prefill=0, num_decode=0, num_both=0)
    with pytest.raises(ConfigError):
        ClusterSpec(kv_load_failure_policy="maybe")
    with pytest.raises(ConfigError):
        ClusterSpec(spread_gpus=-1)
    with pytest.raises(ConfigError):
        ClusterSpec(kv_transport="carrier-pigeon")


def test_up_flags_reach_the_cluster_spec() -> None:
    import argparse

    from kvwire.cluster.cli import add_arguments, spec_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "2", "--decode", "3", "--mode", "pull", "--spread-gpus", "2",
                              "--serve-arg=--num-kv-blocks=64", "--kv-transport", "tcp"])
    spec = spec_from_args(args)
    assert spec.kv_transport.value == "tcp"
    assert (spec.num_prefill, spec.num_decode, spec.spread_gpus) == (2, 3, 2)
    assert spec.mode.value == "pull" and spec.serve_args == ("--num-kv-blocks=64",)


def test_bench_statistics() -> None:
    stats = _percentiles([0.1, 0.2, 0.3, 0.4, 0.5])
    assert stats["p50"] == pytest.approx(0.3) and stats["mean"] == pytest.approx(0.3)
    assert stats["p99"] == pytest.approx(0.496)
    ok = RequestResult(True, 200, num_output_tokens=5, ttft_s=0.1, itls_s=[0.01] * 4, e2e_s=0.5)
    bad = RequestResult(False, 503, error="no live instance")
    summary = summarize("x", [ok, bad], duration_s=2.0)
    assert summary["failed"] == 1 and summary["errors"] == ["no live instance"]
    assert summary["tpot_s"]["mean"] == pytest.approx(0.1)  # (0.5 - 0.1) / 4
    assert summary["output_throughput"] == pytest.approx(2.5)


def test_cluster_start_failure_is_clear_and_leaves_nothing_running() -> None:
    from kvwire.cluster.local import LocalCluster
    from kvwire.errors import ClusterError

    spec = ClusterSpec(serve_args=("--block-size", "0"), start_timeout_s=60, stop_grace_s=5)
    cluster = LocalCluster(spec, sink=io.StringIO())
    start = time.monotonic()
    with pytest.raises(ClusterError, match="exited with code"):
        cluster.start()
    assert time.monotonic() - start < 60
    assert cluster.router is not None and cluster.router.poll() is not None
    assert all(i.process.poll() is not None for i in cluster.instances.values())
