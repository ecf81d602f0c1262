"""Device and backend choice: CPU + gloo when there is no accelerator (the guide's code raises)."""

from __future__ import annotations

import torch

from meshrun.runtime.device import pick_backend, pick_device


def test_cpu_without_accelerator():
    if torch.accelerator.current_accelerator() is None:
        assert pick_device(local_rank=3) == torch.device("cpu")
    assert pick_device(local_rank=0, requested="cpu") == torch.device("cpu")


def test_backend_per_device():
    assert pick_backend(torch.device("cpu")) == "gloo"
    assert pick_backend(torch.device("cpu"), requested="mpi") == "mpi"
    assert pick_backend(torch.device("cuda", 0)) == "nccl"
