"""`meshrun train --profile STEPS`: torch.profiler traces of chosen steps, one Chrome trace per rank.

    meshrun train examples/configs/tiny.toml --profile 10:12   # steps 10, 11 and 12
    meshrun train examples/configs/tiny.toml --profile 5       # step 5 only

Every rank writes runs/<name>/profile/rank<N>.json (open it in https://ui.perfetto.dev or
chrome://tracing); each profiled step is a `ProfilerStep#<step>` span named by its training step.
Memory events are recorded too (profile_memory=True: allocations and frees of the CPU allocator,
and of the GPU's on CUDA). The step before the first profiled one warms the profiler up, so
the first profiled step does not carry its start-up cost. `meshrun report` reads the traces
(meshrun.report.profile). `parse_steps` is torch-free: the CLI checks the flag before launch.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrun.errors import ConfigError

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"
STEP_LABEL = "ProfilerStep#"
_STEPS = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class StepRange:
    """Training steps first..last, both included."""

    first: int
    last: int

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}:{self.last}"


def parse_steps(text: str, total_steps: int) -> StepRange:
    """'10:12' -> StepRange(10, 12), '5' -> StepRange(5, 5); a ConfigError line otherwise."""
    m = _STEPS.match(text or "")
    if not m:
        raise ConfigError(f"--profile {text!r}: give STEP or FIRST:LAST, e.g. --profile 10:12 "
                          f"(steps 10 to 12) or --profile 5")
    first, last = int(m[1]), int(m[2] or m[1])
    if not 1 <= first <= last <= total_steps:
        raise ConfigError(f"--profile {text}: steps must satisfy 1 <= FIRST <= LAST <= train.steps "
                          f"({total_steps}); e.g. --profile {min(2, total_steps)}:{min(3, total_steps)}")
    return StepRange(first, last)


def trace_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / PROFILE_DIR / f"rank{rank}.json"


class StepProfiler:
    """Profiles steps `steps.first..steps.last` of the loop; does nothing when steps is None.

    Call `at(step)` at the top of every step and `close()` after the loop (or on the way out).
    """

    def __init__(self, steps: StepRange | None, run_dir: str | Path, rank: int) -> None:
        self.steps, self.rank = steps, rank
        self.path = trace_path(run_dir, rank)
        self._prof: Any = None
        self._span: Any = None
        self._recording = False

    def at(self, step: int) -> None:
        """Step `step` begins: end the previous step's span, and start, warm up or stop the profiler."""
        if self.steps is None:
            return
        self._end_span()
        first, last = self.steps.first, self.steps.last
        if self._recording and step > last:
            self._finish()
            return
        if step == first - 1 or (step == first and self._prof is None):
            self._prepare(first_step=step)
        if step == first and self._prof is not None and not self._recording:
            self._prof.start_trace()
            self._recording = True
        if self._recording:
            import torch

            self._span = torch.profiler.record_function(f"{STEP_LABEL}{step}")
            self._span.__enter__()

    def close(self) -> None:
        """After the loop: write the trace if the last profiled step was the run's last step."""
        if self.steps is None:
            return
        self._end_span()
        if self._recording:
            self._finish()
        elif self._prof is not None:  # warmed up, never recorded (the run stopped early)
            self._prof.stop_trace()
            self._prof = None

    def _prepare(self, first_step: int) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=False)
        self._prof.prepare_trace()  # warm-up: the start-up cost lands before the recorded steps

    def _end_span(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None

    def _finish(self) -> None:
        self._prof.stop_trace()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._prof.export_chrome_trace(str(tmp))
        tmp.replace(self.path)  # a reader never sees half a trace
        self._prof, self._recording = None, False
        if self.rank == 0:
            logger.info("profile of steps %s written to %s", self.steps, self.path.parent)
