"""benchmarks/handover_split.py on synthetic marks: each point is the first mark after the previous
one, a request missing a point is left out, the totals run from kv_ready to the landing and the step."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Any

_PATH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "handover_split.py"


def _split() -> Any:
    spec = importlib.util.spec_from_file_location("kvwire_bench_handover_split", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _request(module: Any, ready: float, skip: str | None = None) -> list[tuple[str, str]]:
    """Log lines (role, line) of one request whose points come 1 ms apart after ``ready``."""
    # a mark before ``ready`` (an earlier step's end) is not taken
    lines = [("prefill", f"{ready - 0.0005:.6f} prefill kvwire-engine EngineLoop._step out")]
    t = ready
    for _, role, mark in module.POINTS[:-1]:
        t += 0.001
        if mark != skip:
            lines.append((role, f"{t:.6f} {role} kvwire-x {mark} Offer"))
    t += 0.001
    landed = t - 0.0005
    lines.append(("decode", f"{t:.6f} decode kvwire-engine exposed in {ready} {landed}"))
    return lines


def test_points_in_order_and_a_request_missing_one_left_out(tmp_path: pathlib.Path) -> None:
    module = _split()
    lines = _request(module, 1000.0) + _request(module, 1001.0, skip="CompletionEvents.recvd in")
    for role in ("prefill", "decode"):
        text = "".join(line + "\n" for r, line in lines if r == role)
        (tmp_path / f"{role}-1.log").write_text(text)
    labels, rows, grants = module.split(module.load(tmp_path))
    assert grants == 0
    assert len(rows) == 1  # the second request never recorded its completion
    row = rows[0]
    assert len(labels) == len(row) == len(module.POINTS) + 2
    gaps = [round((row[i] - row[i - 1]) * 1e3, 3) for i in range(1, len(row) - 1)]
    assert gaps == [1.0] * len(module.POINTS)
    assert round((row[-1] - row[0]) * 1e3, 3) == len(module.POINTS) - 0.5  # landed
