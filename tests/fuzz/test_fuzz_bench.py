"""``kvwire bench fuzz``: the atheris run per target, its counts, and its message without atheris."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvwire.bench import fuzz

_SRC = str(Path(fuzz.__file__).resolve().parents[2])


def _bench(args: list[str], extra_path: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra_path, _SRC) if p))
    code = "import sys; from kvwire.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "bench", "fuzz", *args], env=env, capture_output=True,
                          text=True, timeout=240, check=False)


def test_bench_fuzz_runs_targets_to_their_input_count() -> None:
    pytest.importorskip("atheris", reason="atheris is a dev extra: pip install 'kvwire[dev]'")
    proc = _bench(["--targets", "connector.trailer,plane.tcp_hello", "--inputs", "3000", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["target"]: r for r in json.loads(proc.stdout)["targets"]}
    assert set(results) == {"connector.trailer", "plane.tcp_hello"}
    for r in results.values():
        assert r["inputs"] == 3000 and r["crashes"] == 0 and not r["error"], r
        assert r["inputs_per_s"] > 0


def test_bench_fuzz_counts_crashes_and_keeps_the_inputs(tmp_path: Path) -> None:
    """A decoder that raises KeyError on inputs starting with ``!``: every such input is counted
    (fuzzing goes on after a crash), kept for reproduction, and the command fails."""
    pytest.importorskip("atheris", reason="atheris is a dev extra: pip install 'kvwire[dev]'")
    (tmp_path / "leaky_decoder.py").write_text(textwrap.dedent('''
        from kvwire.bench.fuzz_targets import FuzzTarget

        def check(data: bytes) -> object:
            if data.startswith(b"!"):
                raise KeyError("leaked")
            if not data:
                raise ValueError("empty")
            return data

        def target() -> FuzzTarget:
            return FuzzTarget("leaky", check, (ValueError,), lambda: [b"!x", b"ok"])
    '''))
    out = tmp_path / "out"
    proc = _bench(["--targets", "leaky_decoder:target", "--inputs", "2000", "--out", str(out), "--json"],
                  extra_path=str(tmp_path))
    assert proc.returncode == 1, proc.stderr[-2000:]
    (result,) = json.loads(proc.stdout)["targets"]
    assert result["inputs"] == 2000 and result["crashes"] >= 2 and result["crash_kinds"] == ["KeyError"]
    kept = sorted((out / "leaky_decoder:target").glob("crash-*.bin"))
    assert kept and all(p.read_bytes().startswith(b"!") for p in kept)


def test_bench_fuzz_without_atheris_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(fuzz.importlib.util, "find_spec", lambda name: None)
    args = argparse.Namespace(targets="all", inputs=10, seconds=0.0, seed=1, out=None, json=False)
    assert fuzz.run(args) == 2
    assert "needs atheris" in capsys.readouterr().err


def test_unknown_target_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown target"):
        fuzz._targets("discovery.frames,no.such")
