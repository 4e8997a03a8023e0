"""`kvwire bench transfer` wiring: JSON keys (an external interface) and bit-exact verification on a
tiny size. Not a timed test: figures are only recorded by running the benchmark."""

from __future__ import annotations

import json

import pytest

from kvwire.cli import main


def test_bench_transfer_json_reports_each_size_verified(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "--log-level",
            "WARNING",
            "bench",
            "transfer",
            "--tokens",
            "32",
            "48",
            "--layers",
            "2",
            "--repeats",
            "1",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [r["tokens"] for r in out["results"]] == [32, 48]
    for r in out["results"]:
        assert {"gbps", "ceiling_gbps", "ratio", "verified", "copy_gbps"} <= set(r)
        assert r["verified"] is True and r["gbps"] > 0 and r["ceiling_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["ceiling_gbps"])


def test_bench_transfer_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--log-level",
                "WARNING",
                "bench",
                "transfer",
                "--tokens",
                "16",
                "--layers",
                "1",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "ceiling GB/s" in table and "True" in table


def test_bench_transfer_shm_compares_memcpy_and_tcp_in_one_run(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--log-level", "WARNING", "bench", "transfer", "--backend", "shm", "--tokens", "32"]
    rc = main([*args, "--layers", "2", "--repeats", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["backend"] == "shm"
    (r,) = out["results"]
    assert r["verified"] is True and min(r["shm_gbps"], r["memcpy_gbps"], r["tcp_gbps"]) > 0
    assert r["one_copy"] is True and r["ring_gbps"] > 0  # shared cache: one copy; ordinary: the ring
    assert r["vs_memcpy"] == pytest.approx(r["shm_gbps"] / r["memcpy_gbps"])
    assert r["vs_tcp"] == pytest.approx(r["shm_gbps"] / r["tcp_gbps"])


def test_bench_transfer_ipc_flow_runs_on_cpu_over_tcp() -> None:
    """The IPC benchmark's two-process flow (D expects first, P sends spans, D verifies every block)
    on CPU over TCP: the protocol is checked here, the GPU figures on the GPU machine."""
    from kvwire.bench.transfer import Shape
    from kvwire.bench.transfer_ipc import Where, measure

    result = measure(48, Shape(num_layers=2), 2, Where(device="cpu", transport="tcp"))
    assert result.verified and result.num_bytes > 0 and result.ipc_seconds > 0
    assert result.copy_seconds == 0.0  # TCP copies nothing on a GPU: no device time reported
