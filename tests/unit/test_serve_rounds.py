"""``kvwire bench serve --rounds N``: setups run in rotating order, round by round, and each setup's
p50s are given as ratios to the last setup named, with their median."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import pytest

from kvwire.bench import serve, serve_rounds
from kvwire.cli import build_parser
from kvwire.errors import ClusterError


def summary(setup: str, ttft: float, itl: float = 0.001, tpot: float = 0.002) -> dict[str, Any]:
    def stats(p50: float) -> dict[str, float]:
        return {"mean": p50, "p50": p50, "p90": p50, "p99": p50}

    return {"setup": setup, "requests": 4, "failed": 0, "errors": [], "duration_s": 1.0,
            "request_throughput": 4.0, "output_throughput": 32.0, "ttft_s": stats(ttft), "itl_s": stats(itl),
            "tpot_s": stats(tpot), "e2e_s": stats(ttft + 0.06), "samples": {"ttft_s": [ttft]}}


def test_rounds_rotate_which_setup_runs_first() -> None:
    assert [serve_rounds.round_order(2, i) for i in range(4)] == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert [serve_rounds.round_order(3, i) for i in range(3)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]


def test_ratios_are_to_the_last_setup_and_skip_a_round_without_a_p50() -> None:
    rounds = [
        [summary("1p1d", 0.011), summary("2colocated", 0.012), summary("colocated", 0.010)],
        [summary("1p1d", 0.013), summary("2colocated", 0.010), summary("colocated", 0.010)],
        [summary("1p1d", math.nan), summary("2colocated", 0.009), summary("colocated", 0.010)],
    ]
    series = {(s.setup, s.metric): s for s in serve_rounds.ratios(rounds)}
    names = ("1p1d", "2colocated")
    assert set(series) == {(name, metric) for name in names for metric, _ in serve_rounds.METRICS}
    ttft = series[("1p1d", "ttft_s")]
    assert ttft.baseline == "colocated" and ttft.values == pytest.approx((1.1, 1.3))  # the NaN round left out
    assert ttft.median == pytest.approx(1.2)
    assert series[("2colocated", "ttft_s")].values == pytest.approx((1.2, 1.0, 0.9))
    assert series[("2colocated", "ttft_s")].median == pytest.approx(1.0)
    assert series[("1p1d", "tpot_s")].values == pytest.approx((1.0, 1.0, 1.0))  # its TPOT was measured
    assert serve_rounds.ratios([[summary("colocated", 0.01)]]) == []  # one setup: nothing to compare


def parse(*extra: str) -> argparse.Namespace:
    argv = ["bench", "serve", "--num-prompts", "2", "--input-len", "4", "--output-len", "2", *extra]
    return build_parser(argv).parse_args(argv)


@pytest.fixture()
def fake_setups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each setup's run returns a fixed summary (1p1d 11 ms TTFT, then 12, 13 ... ms; colocated 10 ms)
    and records the order in which the setups ran."""
    ran: list[str] = []

    def bench_setup(name: str, args: argparse.Namespace, load: serve.LoadSpec) -> dict[str, Any]:
        ran.append(name)
        return summary(name, 0.010 + 0.001 * ran.count(name) if name == "1p1d" else 0.010)

    monkeypatch.setattr(serve, "_bench_setup", bench_setup)
    return ran


def test_three_rounds_rotate_and_print_each_round_and_the_median(
    fake_setups: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    assert serve.run(parse("--rounds", "3")) == 0
    assert fake_setups == ["1p1d", "colocated", "colocated", "1p1d", "1p1d", "colocated"]
    out = capsys.readouterr().out
    assert out.count("round ") == 3 and "run in the order colocated, 1p1d" in out
    assert "p50 ratios to colocated over 3 rounds" in out
    assert "TTFT  1.100 1.200 1.300   median 1.200  min 1.100  max 1.300" in out


def test_rounds_as_json_are_one_list_in_the_named_order_with_each_round(
    fake_setups: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    assert serve.run(parse("--rounds", "2", "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    want = [("1p1d", 1), ("colocated", 1), ("1p1d", 2), ("colocated", 2)]
    assert [(s["setup"], s["round"]) for s in doc] == want
    assert all("samples" not in s for s in doc)
    assert [s["ttft_s"]["p50"] for s in doc if s["setup"] == "1p1d"] == pytest.approx([0.011, 0.012])


def test_one_round_keeps_the_list_output(fake_setups: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.run(parse("--json")) == 0
    assert [s["setup"] for s in json.loads(capsys.readouterr().out)] == ["1p1d", "colocated"]


@pytest.mark.parametrize("extra, says", [
    (("--rounds", "0"), "--rounds must be >= 1"),
    (("--rounds", "2", "--url", "http://127.0.0.1:9"), "does not apply with --url"),
])
def test_rounds_that_cannot_be_run_are_refused(
    fake_setups: list[str], capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], says: str,
) -> None:
    assert serve.run(parse(*extra)) == 2
    assert says in capsys.readouterr().err and fake_setups == []


def test_a_cluster_that_fails_to_start_keeps_the_rounds_that_finished(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    ran: list[str] = []

    def bench_setup(name: str, args: argparse.Namespace, load: serve.LoadSpec) -> dict[str, Any]:
        ran.append(name)
        if len(ran) == 3:  # round 2's first setup
            raise ClusterError("colocated: instance exited during start-up")
        return summary(name, 0.011 if name == "1p1d" else 0.010)

    monkeypatch.setattr(serve, "_bench_setup", bench_setup)
    assert serve.run(parse("--rounds", "3", "--json")) == 1  # failed, but what finished is reported
    doc = json.loads(capsys.readouterr().out)
    assert [(s["setup"], s["round"]) for s in doc] == [("1p1d", 1), ("colocated", 1)]
    ran.clear()
    ran.extend(["x", "x"])  # the first call now fails: nothing finished, nothing reported
    assert serve.run(parse("--rounds", "2", "--json")) == 1
    out = capsys.readouterr()
    assert out.out == "" and "instance exited during start-up" in out.err
