"""Per-rank step statistics and the straggler: which rank is slow, and by how much."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

STRAGGLER_RATIO = 1.10  # slowest/fastest median above this names a straggler
RANK_WARMUP_STEPS = 2  # first records of each rank left out of its median (set-up, first collectives)


def seconds(value: float) -> str:
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


@dataclass
class RankStats:
    rank: int
    num_steps: int
    median_step_s: float
    p90_step_s: float
    median_data_s: float | None = None
    median_compute_s: float | None = None
    peak_mem_bytes: int | None = None


@dataclass
class Straggler:
    """The slowest and the fastest rank by `metric`, and whether the gap makes a straggler."""

    slowest: int
    fastest: int
    slowest_s: float
    fastest_s: float
    metric: str
    is_straggler: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_straggler = self.ratio >= STRAGGLER_RATIO

    @property
    def ratio(self) -> float:
        return self.slowest_s / self.fastest_s if self.fastest_s > 0 else math.inf

    @property
    def note(self) -> str:
        what = "step time" if self.metric == "step_time_s" else "local work (data + compute)"
        gap = (f"median {what} {seconds(self.slowest_s)} vs {seconds(self.fastest_s)} on rank "
               f"{self.fastest} ({self.ratio:.2f}x)")
        if self.is_straggler:
            return f"rank {self.slowest} is a straggler: {gap}"
        return f"ranks are balanced: slowest rank {self.slowest}, {gap}"


def _numbers(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [row[key] for row in rows if isinstance(row.get(key), (int, float))]


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = _numbers(rows, key)
    return statistics.median(values) if values else None


def rank_stats(ranks: dict[int, list[dict[str, Any]]]) -> list[RankStats]:
    """Per-rank medians, leaving out each rank's first RANK_WARMUP_STEPS records."""
    stats = []
    for rank, rows in ranks.items():
        rows = rows[RANK_WARMUP_STEPS:] if len(rows) > RANK_WARMUP_STEPS else rows
        times = sorted(row["step_time_s"] for row in rows)
        stats.append(RankStats(rank=rank, num_steps=len(ranks[rank]), median_step_s=statistics.median(times),
                               p90_step_s=times[min(len(times) - 1, int(0.9 * len(times)))],
                               median_data_s=median_of(rows, "data_time_s"),
                               median_compute_s=median_of(rows, "compute_time_s"),
                               peak_mem_bytes=max(_numbers(ranks[rank], "peak_mem_bytes"), default=None)))
    return stats


def find_straggler(stats: list[RankStats]) -> Straggler | None:
    """The slowest rank against the fastest; None with fewer than two ranks.

    Synchronous training makes every rank's step time equal (the fast ranks wait for the slow
    one inside the collective), so when every rank logged `compute_time_s` the comparison uses
    rank-local work (data + compute) instead, which still shows who is slow.
    """
    if len(stats) < 2:
        return None
    if all(s.median_compute_s is not None for s in stats):
        metric = "local_time_s"
        value = {s.rank: s.median_compute_s + (s.median_data_s or 0.0) for s in stats}
    else:
        metric, value = "step_time_s", {s.rank: s.median_step_s for s in stats}
    slowest, fastest = max(value, key=value.get), min(value, key=value.get)
    return Straggler(slowest=slowest, fastest=fastest, slowest_s=value[slowest],
                     fastest_s=value[fastest], metric=metric)
