"""The one place that decides the order: pp split -> tp -> activation checkpointing -> fsdp or ddp.

Today the data-parallel strategy is DDP; FSDP2, TP and PP slot into this function in that order,
so training code never changes when the `[parallel]` section does.
"""

from __future__ import annotations

import torch
from torch import nn

from meshrun.errors import ConfigError
from meshrun.parallel.checkpointing import apply_activation_checkpointing
from meshrun.parallel.ddp import apply_ddp


def parallelize(
    model: nn.Module,
    parallel_cfg,
    *,
    device: torch.device,
    world_size: int,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Wrap `model` (already on `device`) for the current world as `parallel_cfg` says."""
    strategy = getattr(parallel_cfg, "strategy", "ddp")
    if strategy != "ddp":
        raise ConfigError(f"parallel.strategy={strategy!r} is not available yet; use 'ddp'")
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if world_size > 1:
        model = apply_ddp(model, device)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (`.module`), for saving and inspection."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
