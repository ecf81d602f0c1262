"""AdamW with decoupled weight decay on matrices only, and warmup + cosine/linear/constant LR.

Norm gains and biases are not decayed (as in GPT-2/nanoGPT); the schedule follows
"SGDR" (Loshchilov & Hutter, 2017) cosine decay after a linear warmup (Goyal et al., 2017).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": optim_cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
    )


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int):
    min_ratio = optim_cfg.min_lr / optim_cfg.lr if optim_cfg.lr > 0 else 0.0

    def factor(step: int) -> float:
        return lr_factor(step, total_steps=total_steps, warmup_steps=optim_cfg.warmup_steps,
                         schedule=optim_cfg.schedule, min_ratio=min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
