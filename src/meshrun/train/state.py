"""Everything a checkpoint must capture to continue a run exactly, in one place.

Lists, not single objects, because pipeline parallel may give one rank several stages (model
parts); each part has its own optimizer and LR scheduler (as in torchtitan), so that every
optimizer's state is keyed by its part's parameter names, which stay the same whatever the
layout. Without PP every list holds one element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshrun.data.loader import InfiniteLoader


@dataclass
class TrainState:
    """The live objects of one run; `step` counts optimizer steps completed."""

    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    train_loader: InfiniteLoader
    step: int = 0
    extra: dict = field(default_factory=dict)  # small picklable items to carry (e.g. losses so far)
