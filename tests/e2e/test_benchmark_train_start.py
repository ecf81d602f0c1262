"""benchmarks/train_start.py runs and prints its figures (one repeat: the cost of a short run and of a stop)."""

from __future__ import annotations

import re
import sys

from conftest import REPO, run_proc


def test_train_start_benchmark_prints_cost_and_stop_time():
    result = run_proc([sys.executable, str(REPO / "benchmarks" / "train_start.py"), "--repeats", "1", "--stop",
                       "--timeout", "100"], timeout=240)
    assert result.returncode == 0, result.output
    found = re.search(r"after\s+wall\s+([\d.]+) s\s+CPU\s+([\d.]+) s\s+Ctrl-C to exit\s+([\d.]+) s", result.stdout)
    assert found, result.output
    wall, cpu, stop = map(float, found.groups())
    assert wall > 0 and cpu > 0 and stop > 0, result.output
