"""Test helpers for distributed code: run a function on N real gloo processes, in your own tests.

    import torch
    import torch.distributed as dist
    from meshrun.testing import run_distributed

    def all_reduce_ones() -> float:      # module level: the ranks import it by name
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce():
        assert run_distributed(all_reduce_ones, world_size=4, timeout=60) == [4.0] * 4

A failing rank is re-raised here with its rank and traceback (DistributedTestError), a hang
becomes a DistributedTimeoutError with every rank's stack, and no child outlives the call.
See docs/testing.md.
"""

from __future__ import annotations

from meshrun.testing.errors import (
    DistributedTestError,
    DistributedTimeoutError,
    NotPicklableError,
    RankExitedError,
)
from meshrun.testing.harness import run_distributed

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "NotPicklableError",
    "RankExitedError",
    "run_distributed",
]
