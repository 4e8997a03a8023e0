"""benchmarks/timeline.py on synthetic two-rank traces: iteration starts, transfer ends, host lags."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from typing import Any

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "timeline.py"


def _timeline() -> Any:
    spec = importlib.util.spec_from_file_location("kvwire_bench_timeline", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def _x(name: str, cat: str, ts: float, dur: float, stream: int = 7) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _write(path: pathlib.Path, events: list[dict[str, Any]], base_ns: int) -> str:
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": events}))
    return str(path)


def test_iterations_spans_and_host_lags(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    tl = _timeline()
    sender, receiver = [], []
    for start in (1_000.0, 5_000.0):  # two iterations, 4 ms apart
        sender += [
            _x("t0", "user_annotation", start - 30, 5),
            _x("copy_blocks_kernel", "kernel", start, 6),
            _x("ncclDevKernel_SendRecv", "kernel", start + 8, 100),
        ]
        receiver += [
            _x("ncclDevKernel_SendRecv", "kernel", start - 900, 1_015),  # posted long before
            _x("copy_blocks_kernel", "kernel", start + 116, 10, stream=33),
            _x("end", "user_annotation", start + 140, 3),
            _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", start + 2_000, 1, stream=37),  # next arm
        ]
    # rank 1's trace has its own base: 1 us later, its timestamps 1 us earlier (same clock)
    events = tl.load(_write(tmp_path / "x-r0.json", sender, 0), 0)
    events += tl.load(_write(tmp_path / "x-r1.json", [dict(e, ts=e["ts"] - 1) for e in receiver], 1_000), 1)
    assert tl.origins(events) == [1_000.0, 5_000.0]
    assert tl._transfer_end(events, 1_000.0, 5_000.0) == pytest.approx(1_126.0)  # not the next arm
    tl.report("x", events, [150.0, 151.0], -1, api=False)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    # iteration, host us, GPU span, t0 lead, end lag
    assert rows[0][:5] == ["0", "150.0", "126.0", "30.0", "14.0"]
    assert rows[1][:5] == ["1", "151.0", "126.0", "30.0", "14.0"]
    assert "receiver NCCL kernels: 1" in out


def test_without_markers_each_sender_kernel_starts_an_iteration(tmp_path: pathlib.Path) -> None:
    tl = _timeline()
    sender = [_x("ncclDevKernel_SendRecv", "kernel", t, 200) for t in (100.0, 900.0)]
    receiver = [_x("ncclDevKernel_SendRecv", "kernel", t - 5, 210) for t in (100.0, 900.0)]
    events = tl.load(_write(tmp_path / "a-r0.json", sender, 0), 0)
    events += tl.load(_write(tmp_path / "a-r1.json", receiver, 0), 1)
    assert tl.origins(events) == [100.0, 900.0]
    assert tl._transfer_end(events, 100.0, 900.0) == pytest.approx(305.0)
