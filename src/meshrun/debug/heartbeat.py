"""This process's heartbeat: the counter the hang watchdog reads, and its last collectives.

Standard library only and as cheap as Python allows: `meshrun.heartbeat()` is one increment of
the counter on the process's runtime object (meshrun.runtime.process), so a training loop may
call it every step (meshrun's trainer does, through optimizer steps).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

RECENT = 8  # collectives kept for the hang report
STEP_WINDOW = 50  # step times kept: the hang watchdog's bound follows their p99 (watchdog.py)
SETUP_PHASE = "setup"  # the phase whose length bounds the first step (watchdog.py)


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


class Heartbeat:
    """Steps, batches and returned collectives counted; the last RECENT collectives kept; the
    times between optimizer steps, and the slow phases (eval, checkpoint, compile) announced now."""

    def __init__(self) -> None:
        self.count = 0
        self.recent: deque[CollectiveRecord] = deque(maxlen=RECENT)
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)  # seconds between two optimizer steps
        self._last_step: float | None = None  # None after a phase: its time is not a step's
        self.phases: list[str] = []  # announced phases running now, outermost first
        self.paced = False  # a phase was announced: the code says where its slow parts are
        self.setup_s: float | None = None  # how long the SETUP_PHASE took
        # set while the hang watchdog reports: the process is about to exit, and an error the main
        # thread meets meanwhile (a peer that has already exited) is a consequence, not news
        self.hang_reported = threading.Event()
        self.job_ending = threading.Event()  # a peer has finished: its store may be gone

    def beat(self) -> None:
        self.count += 1

    def step(self) -> None:
        """An optimizer step: progress, and the time since the previous one (outside phases)."""
        self.count += 1
        now = time.monotonic()
        if self._last_step is not None and not self.phases:
            self.step_times.append(now - self._last_step)
        self._last_step = now

    @contextmanager
    def phase(self, what: str):
        """A stretch that may take longer than a step (eval, checkpoint save, compile, setup): the
        hang watchdog waits its long bound while any rank is in one; its end is progress."""
        started = time.monotonic()
        self.paced = True
        self.phases.append(what)
        try:
            yield
        finally:
            self.phases.remove(what)
            self.count += 1
            self._last_step = None
            if what == SETUP_PHASE:
                self.setup_s = time.monotonic() - started

    def begin(self, record: CollectiveRecord) -> None:
        self.recent.append(record)

    def end(self, record: CollectiveRecord, *, count: bool = True) -> None:
        record.ended = time.time()
        if count:
            self.count += 1

    def open_collective(self) -> CollectiveRecord | None:
        """The collective this rank is inside, if any."""
        last = self.recent[-1] if self.recent else None
        return last if last is not None and last.ended is None else None

