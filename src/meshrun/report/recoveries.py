"""Failures and recoveries of a run, from its own records, and the goodput they left.

A recovery is a start of the workers that the agent made after a failure (`--max-restarts`,
`attempt` >= 1 in `<run dir>/events.jsonl`): rank 0's `resumed` event says from which step and
source (snapshot, peer, disk), its `first_step` event when training went on. The failure is
placed at the last train row rank 0 logged before that start (exact with `metrics.interval = 1`,
else up to an interval early). Standard library only.

The goodput here is an estimate from one run: 1 - lost / wall, where each recovery loses the time
from that last row to the first step after the restart, plus the steps it computed again at the
median step time. `benchmarks/goodput.py` measures it against a fault-free run instead.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Recovery:
    failed_after: int
    """The last step rank 0 logged before the failure."""
    resumed_at: int
    """The step whose state the restarted workers loaded."""
    source: str
    """Where that state came from: snapshot, peer, disk, or none (step 0)."""
    down_s: float
    """From the last logged step before the failure to the first completed step after it."""
    redone: int
    """Steps computed again: failed_after - resumed_at."""

    def describe(self) -> str:
        redo = f", {self.redone} step{'s' if self.redone != 1 else ''} redone" if self.redone else ""
        return (f"failed after step {self.failed_after}, resumed at step {self.resumed_at} from "
                f"{self.source}, {self.down_s:.1f} s to the next step{redo}")


def _rank0(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == name and e.get("rank") == 0
            and isinstance(e.get("time"), (int, float)) and isinstance(e.get("attempt"), int)]


def find_recoveries(events: list[dict[str, Any]], train_rows: list[dict[str, Any]]) -> list[Recovery]:
    """Every agent restart after a failure, in time order (train_rows: rank 0's rows as logged,
    redone steps included)."""
    rows = sorted((r for r in train_rows if isinstance(r.get("time"), (int, float))
                   and isinstance(r.get("step"), int)), key=lambda r: r["time"])
    firsts = _rank0(events, "first_step")
    starts = _rank0(events, "worker_start")
    found = []
    for resumed in sorted(_rank0(events, "resumed"), key=lambda e: e["time"]):
        if resumed["attempt"] < 1:
            continue  # a launch's first start: not a recovery
        started = max((s["time"] for s in starts if s["attempt"] == resumed["attempt"]
                       and s.get("pid") == resumed.get("pid")), default=resumed["time"])
        before = [r for r in rows if r["time"] < started]
        first = min((f["time"] for f in firsts if f["attempt"] == resumed["attempt"]
                     and f.get("pid") == resumed.get("pid")), default=None)
        if not before or first is None:
            continue
        last = before[-1]
        step = resumed.get("step") if isinstance(resumed.get("step"), int) else 0
        found.append(Recovery(failed_after=last["step"], resumed_at=step, source=resumed.get("source") or "none",
                              down_s=max(0.0, first - last["time"]), redone=max(0, last["step"] - step)))
    return found


def goodput_estimate(recoveries: list[Recovery], train_rows: list[dict[str, Any]]) -> float | None:
    """1 - lost / wall over the run's logged steps; None without recoveries or step times."""
    times = [r["time"] for r in train_rows if isinstance(r.get("time"), (int, float))]
    steps = [r["step_time_s"] for r in train_rows if isinstance(r.get("step_time_s"), (int, float))]
    if not recoveries or len(times) < 2 or not steps:
        return None
    wall = max(times) - min(times)
    lost = sum(r.down_s + r.redone * statistics.median(steps) for r in recoveries)
    return max(0.0, 1.0 - lost / wall) if wall > 0 else None
