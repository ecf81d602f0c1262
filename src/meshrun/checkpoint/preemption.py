"""Preemption: SIGTERM/SIGINT noted by a handler, agreed by every rank at a step boundary.

The Checkpointer installs the handlers when it opens and puts the previous ones back when it
closes (`close()`, the end of its `with` block, a preemption, or `meshrun.shutdown()`), so no
handler outlives the training it serves. The step then saves a checkpoint and raises Preempted;
the worker exits 0 and `meshrun train` tells the user that re-running the command continues.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.checkpoint import manifest as mf

PREEMPTED_FILE = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """SIGTERM/SIGINT arrived; a checkpoint of `step` is committed and the worker should exit 0."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint committed")
        self.step, self.signum = step, signum


class PreemptionSignals:
    """SIGTERM/SIGINT handlers that only note the signal, installed until `restore()`."""

    def __init__(self) -> None:
        self.signum, self._at = 0, 0.0
        # Python installs handlers from the main thread only. Training that a framework runs on a
        # thread of its own (Ray Train: cluster/ray.py) leaves the process's signals to that framework.
        main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS} if main else {}

    def _on_signal(self, signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        if self.signum and time.monotonic() - self._at > 1.0:  # asked again, later: stop now
            raise KeyboardInterrupt
        if not self.signum:
            self.signum, self._at = signum, time.monotonic()

    def agreed(self, world_size: int, device: torch.device) -> int:
        """The signal any rank got, agreed by every rank at the same step (a small all_reduce)."""
        if world_size == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        """Put back the handlers that were there before (idempotent)."""
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._previous = {}


def write_marker(root: Path, *, step: int, signum: int, session: int) -> None:
    """What `preempted_exit_code` reads: the step whose checkpoint the signal produced."""
    (root / PREEMPTED_FILE).write_text(json.dumps(
        {"step": step, "signal": signal.Signals(signum).name, "session": session}))


def preempted_exit_code(run_dir: Path, signum: int, *, since: float) -> int:
    """The agent's exit code after SIGTERM/SIGINT: 0 when the workers committed a checkpoint since `since`.

    Otherwise 128 + the signal number (143 for SIGTERM), the shell's convention for "killed by
    a signal", which schedulers treat as preempted. Either way re-running the command resumes.
    """
    name = signal.Signals(signum).name
    marker = mf.checkpoints_dir(run_dir) / PREEMPTED_FILE
    try:
        if marker.stat().st_mtime >= since:
            step = json.loads(marker.read_text())["step"]
            print(f"meshrun train: stopped by {name} at step {step}, checkpoint committed; "
                  "re-run the same command to continue", file=sys.stderr)
            return 0
    except (OSError, ValueError, KeyError):
        pass
    print(f"meshrun train: stopped by {name} before a checkpoint was committed; re-running the same "
          "command continues from the latest valid checkpoint", file=sys.stderr)
    return 128 + signum
