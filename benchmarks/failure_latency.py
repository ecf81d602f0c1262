"""Failure latency: how long meshrun's bounded waits really take to end, on real processes.

    python benchmarks/failure_latency.py --repeats 3

The tests check that each of these waits ends and what it reports; how fast is measured here,
where machine load cannot fail CI. Each figure is the median of --repeats runs:
1. run_distributed's timeout: a rank hangs in an all_reduce its peer never joins, under
   timeout=T; seconds past T until DistributedTimeoutError is raised (every rank killed and reaped).
2. A failing rank releases its peers: rank 1 raises before a collective that rank 0 has entered,
   under meshrun.init()/shutdown(); seconds from the call to DistributedTestError (torch's own
   gloo timeout would be 30 minutes).
3. `meshrun doctor`'s smoke check with --timeout 0.3: seconds until it has killed its two
   workers and returned its FAIL line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import meshrun
from meshrun.testing import DistributedTestError, DistributedTimeoutError, run_distributed

# Rank functions live at module level: spawned ranks import them by name.


def hang_on_rank_0() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never calls it


def fail_on_rank_1() -> None:
    env = meshrun.init()
    if env.rank == 1:
        raise ValueError("rank 1 fails before the collective")
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        meshrun.shutdown()


def past_timeout(timeout: float) -> float:
    start = time.monotonic()
    try:
        run_distributed(hang_on_rank_0, world_size=2, timeout=timeout)
    except DistributedTimeoutError:
        return time.monotonic() - start - timeout
    raise SystemExit("run_distributed did not time out")


def peers_released() -> float:
    start = time.monotonic()
    try:
        run_distributed(fail_on_rank_1, world_size=2, timeout=120, init=False)
    except DistributedTestError:
        return time.monotonic() - start
    raise SystemExit("rank 1's error was not reported")


def smoke_timeout() -> float:
    from meshrun.doctor import smoke

    start = time.monotonic()
    check = smoke.run_smoke(timeout=0.3, environ={})
    if "did not finish within 0.3 s" not in check.detail:
        raise SystemExit(f"the smoke check did not time out: {check.detail}")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0, help="run_distributed's timeout in figure 1")
    args = parser.parse_args()
    figures = {
        f"run_distributed: seconds past timeout={args.timeout:g}": lambda: past_timeout(args.timeout),
        "failing rank: seconds until its peers are released and it is reported": peers_released,
        "doctor smoke --timeout 0.3: seconds until its workers are killed": smoke_timeout,
    }
    for label, measure in figures.items():
        values = [measure() for _ in range(args.repeats)]
        print(f"{label}: median {statistics.median(values):.2f} (runs: {', '.join(f'{v:.2f}' for v in values)})",
              flush=True)


if __name__ == "__main__":
    main()
