"""``kvwire bench serve --rounds N`` on the random workload: the local setups run N times, their order
rotated by one each round (as ``--policies`` rounds are), and each setup's p50 TTFT, ITL and TPOT are
given as ratios to the last setup named (the baseline), round by round, with their median. With
``--json`` every summary carries its ``round`` (1-based).

One run of two setups one after the other on a small shared box is off by several percent: on the
2-core CPU box the same setup twice (``--setups colocated,colocated``) gave TTFT p50 ratios of
0.75-1.17 round by round (docs/decisions/168-ratios-over-rotating-rounds.md). A ratio is worth
quoting as the median of rotating rounds, beside that noise floor.

:func:`round_order` is also the rotation of ``--policies`` rounds (:mod:`kvwire.bench.serve_policies`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

METRICS = (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"))


def round_order(count: int, index: int) -> list[int]:
    """The positions of ``count`` setups in the order round ``index`` (0-based) runs them: rotated by
    one per round, so that no setup is always the one measured first while the box's load drifts."""
    shift = index % count if count else 0
    return [*range(shift, count), *range(shift)]


@dataclasses.dataclass(frozen=True)
class RatioSeries:
    """One setup's p50 of one metric divided by the baseline's, per round."""

    setup: str
    baseline: str
    metric: str
    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")


def _p50(summary: dict[str, Any], metric: str) -> float:
    return float(summary[metric]["p50"])


def ratios(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[RatioSeries]:
    """Per metric, every setup but the last against the last, over ``rounds`` (each a list of
    summaries in the order the setups were named). A round where either p50 is missing (NaN: every
    request failed) or the baseline's is zero is left out of that series."""
    if not rounds or len(rounds[0]) < 2:
        return []
    series = []
    for position in range(len(rounds[0]) - 1):
        for metric, _ in METRICS:
            values = []
            for summaries in rounds:
                top, bottom = _p50(summaries[position], metric), _p50(summaries[-1], metric)
                if not math.isnan(top) and not math.isnan(bottom) and bottom > 0:
                    values.append(top / bottom)
            setup, baseline = rounds[0][position]["setup"], rounds[0][-1]["setup"]
            series.append(RatioSeries(setup, baseline, metric, tuple(values)))
    return series


def print_ratios(series: Sequence[RatioSeries], num_rounds: int) -> None:
    if not series:
        return
    labels = dict(METRICS)
    print(f"p50 ratios to {series[0].baseline} over {num_rounds} rounds (order rotating):")
    for s in series:
        values = " ".join(f"{v:.3f}" for v in s.values)
        spread = f"min {min(s.values):.3f}  max {max(s.values):.3f}" if s.values else "no round with both"
        print(f"  {s.setup:<12}{labels[s.metric]:<6}{values}   median {s.median:.3f}  {spread}")
