"""Pick the device and the process-group backend: accelerator + NCCL (or its peer), else CPU + gloo."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from meshrun.errors import MeshrunError


def pick_device(local_rank: int, requested: str | None = None) -> torch.device:
    """One device per local rank on accelerators; CPU when `torch.accelerator` finds none.

    The guide's `torch.accelerator.set_device_index(local_rank)` raises on CPU, so this is the
    single place that decides.
    """
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cpu":
            return torch.device("cpu")
        if not torch.accelerator.is_available():
            raise MeshrunError(f"device={requested!r} was requested but no accelerator is available; use device='cpu'")
    accelerator = torch.accelerator.current_accelerator() if requested is None else device
    if accelerator is None:
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    if count == 0:
        return torch.device("cpu")
    index = device.index if requested is not None and device.index is not None else local_rank % count
    torch.accelerator.set_device_index(index)
    return torch.device(accelerator.type, index)


def pick_backend(device: torch.device, requested: str | None = None) -> str:
    """`dist.get_default_backend_for_device`, but gloo on CPU and on Windows (no NCCL there)."""
    if requested:
        return requested
    if device.type == "cpu" or sys.platform == "win32":
        return "gloo"
    return dist.get_default_backend_for_device(device)
