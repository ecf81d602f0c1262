"""Data parallel with DistributedDataParallel: the guide's strategy, device_ids only on accelerators."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, device: torch.device, *, process_group=None) -> DDP:
    """Wrap `model` in DDP. `device_ids` is passed for a single-accelerator module and omitted on
    CPU, where DDP rejects it (the guide's `device_ids` row: always pass it, except on CPU)."""
    device_ids = None if device.type == "cpu" else [device.index or 0]
    return DDP(model, device_ids=device_ids, process_group=process_group,
               forward_sync_buffers=_has_persistent_buffers(model))


def _has_persistent_buffers(model: nn.Module) -> bool:
    """Only buffers that are state (BatchNorm statistics) need DDP's per-step broadcast; derived
    tables every rank computes alike (RoPE) would just cost a collective per step."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                return True
    return False
