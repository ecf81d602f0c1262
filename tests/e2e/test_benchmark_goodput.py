"""The goodput benchmarks, run short: they must keep working, and their checks must keep holding.

The fault-tolerance figures (docs/fault-tolerance.md) come from `benchmarks/goodput.py` (exact mode and the torchrun + DCP baseline)
and its `--mode torchft`. Nothing here asserts a time or a ratio (the machine is shared); each run
must finish, kill at least once, recover every kill, and report the exactness checks as held.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from conftest import REPO, run_proc

GOODPUT = str(REPO / "benchmarks" / "goodput.py")


def _recoveries(out: str) -> list[int]:
    return [int(n) for n in re.findall(r"^  (\d+) recoveries", out, re.M)]


# Sized to pass with a wide margin on a machine half as fast, or beside another job. The benchmark's
# own limit per run is 3 x --minutes + 1 min.
pytestmark = pytest.mark.timeout(600)

# Exact mode: one kill per faulty run, the first step past 3 s. A kill waits for --kill-after-steps
# steps since the last recovery began, and a restarted 60-step run has at most 60 left, so with
# EXACT_STEPS + 1 no second kill is ever due (with 20, 4 kills a run: torchrun's baseline spent
# 16 s and two `import torch` on each of its restarts, ~20 CPU-s, for a count the test needs >= 1).
EXACT_STEPS = 60


def test_exact_mode_and_torchrun_baseline_recover_every_kill_bitwise():
    result = run_proc([sys.executable, GOODPUT, "--steps", str(EXACT_STEPS), "--kill-every", "3", "--side-by-side",
                       "--kill-after-steps", str(EXACT_STEPS + 1), "--minutes", "2"], timeout=500)
    assert result.returncode == 0, result.output[-4000:]
    out = result.stdout
    assert "meshrun (exact): goodput" in out and "torchrun + DCP (the guide's way): goodput" in out, out
    assert "final model.pt bitwise equal to the fault-free run's: yes" in out, out
    counts = _recoveries(out)
    assert len(counts) == 2 and all(n >= 1 for n in counts), out  # meshrun's and the baseline's
    assert "not recovered" not in out and "stopped unfinished" not in out, out


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="the torchft extra is not installed")
def test_torchft_mode_keeps_survivors_and_accounts_for_every_sample():
    # 240 steps with a disk checkpoint every 5 (the default --interval): ~15 s at a quiet machine's
    # pace, room for a kill once both groups have joined and 6 s before the end (QUIET_TAIL_S). With
    # --interval 20 the run took 11.9 s and no kill was ever due (seen in a suite run).
    result = run_proc([sys.executable, GOODPUT, "--mode", "torchft", "--steps", "240", "--kill-every", "4",
                       "--side-by-side", "--minutes", "2"], timeout=500)
    assert result.returncode == 0, result.output[-4000:]
    out = result.stdout
    assert "NO survivor restarted" in out, out
    ledgers = re.findall(r"^  with(?:out)? faults: data: .*$", out, re.M)  # the fault-free run's and the faulty run's
    assert len(ledgers) == 2 and all("each exactly once" in line and "DIFFER" not in line for line in ledgers), out
    counts = _recoveries(out)
    assert counts and counts[0] >= 1, out
    assert "not recovered" not in out and "stopped unfinished" not in out, out
