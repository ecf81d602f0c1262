"""Ports for test runs that start their own stores: free now, and never another parallel worker's.

A port the OS hands out (bind to 0, close) is free only until someone binds it; two test
processes that pick and then bind a few seconds later could pick the same one. A test runner that
runs tests in parallel (pytest-xdist; tests/conftest.py) sets MESHRUN_TEST_PORTS=LO-HI to a range
of its own for each worker, below the OS's ephemeral range, so that neither another worker nor an
outgoing connection can be handed the same port. The launcher picks rank 0's MASTER_PORT the same
way (meshrun.launch.ports.quiet_port), so a job a test starts stays in that worker's range too.
"""

from __future__ import annotations

from meshrun.launch.ports import PORT_RANGE_VAR, QUIET_POOL
from meshrun.launch.ports import quiet_port as pick_port

__all__ = ["PORT_RANGE_VAR", "POOL", "pick_port", "worker_range"]

POOL = QUIET_POOL


def worker_range(index: int, count: int) -> str:
    """The MESHRUN_TEST_PORTS value of parallel worker `index` of `count` (disjoint slices of POOL)."""
    if not 0 <= index < count:
        raise ValueError(f"worker index {index} is not in 0..{count - 1}")
    size = (POOL[1] - POOL[0] + 1) // count
    lo = POOL[0] + index * size
    return f"{lo}-{lo + size - 1}"
