"""Stragglers named live, while the run goes on (the report names them afterwards: report/ranks.py).

Synchronous steps take equally long on every rank (the fast ones wait for the slow one inside the
gradient all-reduce), so a straggler shows only in each rank's own work: the time it waited for its
batch plus its forward pass (train/step.py measures the forward free of waiting on peers under DDP).
Every WINDOW steps the ranks share the median of their own work over those steps (one all_gather
of two numbers), and every rank sees the same verdict: a rank whose median is at least RATIO x
the median of the others', and MIN_GAP_S more, in CONFIRM windows in a row, is a straggler (one
window alone flickers on a loaded machine: 1.3x for 50 steps, then balanced again). Rank 0 says so once, when it is
first named (the progress line and a `straggler` row in metrics.jsonl), and once more when it is
no longer (`straggler_cleared`). Medians, not means: one slow step (a GC pause, a page fault)
names nobody; "consistently slower" is what counts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

WINDOW = 50  # steps per verdict
RATIO = 1.2  # a rank's own work over the others' median that names it
MIN_GAP_S = 0.002  # and by at least this much: 1.2 x a 0.3 ms forward is noise nobody waits for
CONFIRM = 2  # windows in a row: a rank is named within CONFIRM x WINDOW steps of becoming slow


@dataclass(frozen=True)
class Straggler:
    rank: int
    ratio: float  # its median own work over the others' median
    own_s: float
    others_s: float
    data_share: float  # of its own work, the part spent waiting for data

    def line(self) -> str:
        return (f"rank {self.rank} is {self.ratio:.1f}x slower than the median of the others "
                f"({self.own_s * 1000:.3g} ms of its own work a step against {self.others_s * 1000:.3g} ms): "
                f"its data wait is {self.data_share:.0%} of it")


def judge(data_s: list[float], forward_s: list[float]) -> list[Straggler]:
    """Every rank's median data wait and forward time over a window -> the stragglers among them."""
    own = [d + f for d, f in zip(data_s, forward_s, strict=True)]
    found = []
    for rank, mine in enumerate(own):
        others = statistics.median(own[:rank] + own[rank + 1:])
        if others > 0 and mine >= RATIO * others and mine - others >= MIN_GAP_S:
            found.append(Straggler(rank, mine / others, mine, others, data_s[rank] / mine if mine else 0.0))
    return found


class TimedBatches:
    """The loader's batches, with the time spent waiting for each added up (`waited_s`)."""

    def __init__(self, batches) -> None:
        self.batches, self.waited_s = batches, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        started = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.waited_s += time.perf_counter() - started


class StragglerWatch:
    """Collects this rank's own work per step; every WINDOW steps, the verdict (a collective: every
    rank calls `add` on the same steps). Off for one rank and for pipelines (stages differ in work)."""

    def __init__(self, world_size: int, device: torch.device, *, enabled: bool = True) -> None:
        self.enabled = enabled and world_size > 1 and dist.is_available() and dist.is_initialized()
        self.world_size, self.device = world_size, device
        self.data: list[float] = []
        self.forward: list[float] = []
        self.named: dict[int, Straggler] = {}
        self.streak: dict[int, int] = {}  # rank -> windows in a row it was slow

    def add(self, data_s: float, forward_s: float) -> tuple[list[Straggler], list[int]]:
        """(newly named stragglers, ranks no longer stragglers): empty but every WINDOW steps."""
        if not self.enabled:
            return [], []
        self.data.append(data_s)
        self.forward.append(forward_s)
        if len(self.data) < WINDOW:
            return [], []
        mine = torch.tensor([statistics.median(self.data), statistics.median(self.forward)],
                            dtype=torch.float64, device=self.device)
        self.data.clear()
        self.forward.clear()
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        rows = [t.tolist() for t in every]
        slow = {s.rank: s for s in judge([r[0] for r in rows], [r[1] for r in rows])}
        self.streak = {rank: self.streak.get(rank, 0) + 1 for rank in slow}
        found = {rank: s for rank, s in slow.items() if self.streak[rank] >= CONFIRM or rank in self.named}
        new = [s for rank, s in found.items() if rank not in self.named]
        gone = [rank for rank in self.named if rank not in found]
        self.named = found
        return new, gone
