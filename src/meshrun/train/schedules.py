"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay.

Every schedule is a multiplier of the peak `optim.lr` per optimizer step, run by torch's
`LambdaLR` (so its state is the step counter, checkpointed with the run). Warmup is linear from
lr / warmup_steps to lr (Goyal et al., arXiv:1706.02677); cosine decay follows SGDR (Loshchilov
& Hutter, arXiv:1608.03983) without restarts; warmup-stable-decay holds the peak lr, then decays
linearly over the last `decay_fraction` of the steps after warmup (Hu et al., MiniCPM,
arXiv:2404.06395; Hägele et al., arXiv:2405.18392). Every decay reaches `min_lr` at the last
step (`total_steps - 1`, 0-based), so the run's last update is taken at `min_lr`.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float,
              decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based); min_ratio = min_lr / lr."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    last = total_steps - 1  # the last step, where every decay reaches min_ratio
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * max(1, total_steps - warmup_steps)))
        start = last - decay_steps  # the last step at the peak; the decay takes the `decay_steps` after it
        if step <= start:
            return 1.0
        progress = min(1.0, (step - start) / decay_steps)
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    progress = min(1.0, max(0, step - warmup_steps) / max(1, last - warmup_steps))
    if schedule == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int):
    """`LambdaLR` over `optimizer` following `optim_cfg.schedule` for a run of `total_steps`."""
    min_ratio = optim_cfg.min_lr / optim_cfg.lr if optim_cfg.lr > 0 else 0.0

    def factor(step: int) -> float:
        return lr_factor(step, total_steps=total_steps, warmup_steps=optim_cfg.warmup_steps,
                         schedule=optim_cfg.schedule, min_ratio=min_ratio,
                         decay_fraction=optim_cfg.decay_fraction)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
