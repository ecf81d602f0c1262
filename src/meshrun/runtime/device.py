"""Devices: how many processes a node runs by default, and each one's device and process-group
backend (accelerator + NCCL or its peer, else CPU + gloo). Imports torch only when asked."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from meshrun.errors import MeshrunError

if TYPE_CHECKING:
    import torch

MAX_AUTO_CPU_PROCS = 4


def auto_nproc_per_node(*, import_torch: bool = True) -> int:
    """`--nproc-per-node auto`: one process per accelerator; on CPU, the cores, at least 2, at most 4.

    import_torch=False answers without importing torch (for a hint printed by a plain-python
    process): it asks torch only when it is already imported, else counts /dev/nvidiaN.
    """
    torch = sys.modules.get("torch")
    if torch is None and import_torch:
        import torch
    gpus = 0
    if torch is not None:
        try:
            gpus = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
        except (AttributeError, RuntimeError):
            gpus = 0
    else:
        try:
            gpus = len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
        except OSError:
            gpus = 0
    if gpus > 0:
        return gpus
    return max(2, min(MAX_AUTO_CPU_PROCS, usable_cpus()))


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pick_device(local_rank: int, requested: str | None = None) -> torch.device:
    """One device per local rank on accelerators; CPU when `torch.accelerator` finds none.

    The guide's `torch.accelerator.set_device_index(local_rank)` raises on CPU, so this is the
    single place that decides.
    """
    import torch

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
    import torch.distributed as dist

    return dist.get_default_backend_for_device(device)
