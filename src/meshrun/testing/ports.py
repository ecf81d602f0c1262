"""Ports for test runs that start their own stores: free now, and never another parallel worker's.

A port the OS hands out (bind to 0, close) is free only until someone binds it; two test
processes that pick and then bind a few seconds later could pick the same one. A test runner that
runs tests in parallel (pytest-xdist; tests/conftest.py) sets MESHRUN_TEST_PORTS=LO-HI to a range
of its own for each worker, below the OS's ephemeral range, so that neither another worker nor an
outgoing connection can be handed the same port. Without the variable: the OS's choice.
"""

from __future__ import annotations

import os
import random
import socket

from meshrun.launch.ports import free_port

PORT_RANGE_VAR = "MESHRUN_TEST_PORTS"
# Below Linux's default ephemeral range (32768-60999) and torch's default ports (29400, 29500).
POOL = (10000, 28999)


def worker_range(index: int, count: int) -> str:
    """The MESHRUN_TEST_PORTS value of parallel worker `index` of `count` (disjoint slices of POOL)."""
    if not 0 <= index < count:
        raise ValueError(f"worker index {index} is not in 0..{count - 1}")
    size = (POOL[1] - POOL[0] + 1) // count
    lo = POOL[0] + index * size
    return f"{lo}-{lo + size - 1}"


def pick_port(host: str = "127.0.0.1") -> int:
    """A port free right now: from MESHRUN_TEST_PORTS when it is set, else any the OS offers."""
    spec = os.environ.get(PORT_RANGE_VAR, "")
    if not spec:
        return free_port(host)
    try:
        lo, hi = (int(part) for part in spec.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_VAR}={spec!r}: expected LO-HI, e.g. 20000-20999") from None
    ports = list(range(lo, hi + 1))
    start = random.randrange(len(ports))  # a run's store may still be in TIME_WAIT: move on
    for port in ports[start:] + ports[:start]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"{PORT_RANGE_VAR}={spec}: no free port in the range")
