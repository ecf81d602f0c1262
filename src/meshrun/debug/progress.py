"""This process's progress: a counter the hang watchdog reads, and its last collectives.

Standard library only and as cheap as Python allows: `heartbeat()` is one integer increment,
so a training loop may call it every step (meshrun's trainer does, through optimizer steps).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RECENT = 8  # collectives kept for the hang report

_count = 0


def heartbeat() -> None:
    """Tell the hang watchdog this rank made progress (a step, a batch, a phase)."""
    global _count
    _count += 1


def count() -> int:
    return _count


@dataclass
class CollectiveRecord:
    """One collective as this rank called it: what, where, and whether it returned."""

    seq: int
    op: str
    group: str
    tensors: str
    site: str
    started: float = field(default_factory=time.time)
    ended: float | None = None

    def describe(self) -> str:
        state = "returned" if self.ended is not None else f"NOT returned after {time.time() - self.started:.0f}s"
        return f"#{self.seq} {self.op}({self.tensors}) group={self.group} at {self.site}: {state}"


recent: deque[CollectiveRecord] = deque(maxlen=RECENT)


def begin(record: CollectiveRecord) -> None:
    recent.append(record)


def end(record: CollectiveRecord) -> None:
    record.ended = time.time()
    heartbeat()


def open_collective() -> CollectiveRecord | None:
    """The collective this rank is inside, if any."""
    last = recent[-1] if recent else None
    return last if last is not None and last.ended is None else None
