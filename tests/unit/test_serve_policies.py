"""``kvwire bench serve --policies … --rounds N``: policies interleaved with a rotating order, ratios
against round robin of the same round, the median over rounds (no clusters: bench_policy is faked)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import pytest

from kvwire.bench import serve_policies
from kvwire.bench.serve_policies import print_policy_table, run_compare, ttft_ratio
from kvwire.bench.workloads import Session, add_arguments
from kvwire.cluster.client import RequestResult

TTFT_S = {"round_robin": [0.100, 0.050, 0.200], "kv_aware": [0.050, 0.040, 0.080]}  # per round


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", default="2p2d")
    parser.add_argument("--policies", default=None)
    for name in ("--num-prompts", "--input-len", "--output-len", "--seed"):
        parser.add_argument(name, type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--arrival", default="poisson")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rounds_rotate_the_policy_order_and_compare_within_a_round(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[str | None] = []

    def fake_bench(setup: tuple[int, int, int], name: str, policy: str | None, a: argparse.Namespace,
                   sessions: Sequence[Session]) -> tuple[list[RequestResult], float, dict[str, float]]:
        round_ = sum(1 for c in calls if c == policy)
        calls.append(policy)
        result = RequestResult(True, 200, ttft_s=TTFT_S[policy or ""][round_], e2e_s=0.3)
        counters = {"hit_tokens": 0.0, "prompt_tokens": 1.0, "kv_bytes": 1024.0, "skipped": 0.0,
                    "partial": 0.0}
        return [result], 1.0, counters

    monkeypatch.setattr(serve_policies, "bench_policy", fake_bench)
    summaries = run_compare(args("--policies", "round_robin,kv_aware", "--rounds", "3",
                                 "--workload", "shared-prefix"), {"2p2d": (2, 2, 0)})
    assert calls == ["round_robin", "kv_aware", "kv_aware", "round_robin", "round_robin", "kv_aware"]
    assert [s["round"] for s in summaries] == [1, 1, 2, 2, 3, 3]
    base = {("2p2d", s["round"]): s for s in summaries if s["setup"].endswith("round_robin")}
    ratios = [ttft_ratio(s, base) for s in summaries if s["setup"].endswith("kv_aware")]
    assert ratios == pytest.approx([0.5, 0.8, 0.4])
    print_policy_table(summaries)
    out = capsys.readouterr().out
    summary_line = next(line for line in out.splitlines()
                        if line.startswith("2p2d/kv_aware") and "0.50 0.80" in line)
    assert summary_line.split()[1] == "0.50"  # the median of 0.5, 0.8, 0.4


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--rounds"):
        run_compare(args("--policies", "round_robin", "--rounds", "0"), {"2p2d": (2, 2, 0)})


def summary(ttft: dict[str, Any]) -> dict[str, Any]:
    return {"setup": "2p2d/kv_aware", "ttft_s": ttft}


def test_no_ratio_without_round_robin() -> None:
    assert ttft_ratio(summary({"p50": 0.1}), {}) is None
