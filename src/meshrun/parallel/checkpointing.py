"""Activation checkpointing per transformer block: recompute activations in backward to save memory."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap each block of `model.layers` (a ModuleDict or ModuleList); returns how many were wrapped.

    Non-reentrant checkpointing (torch.utils.checkpoint, use_reentrant=False) as torchtitan does.
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        return 0
    names = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else list(range(len(layers)))
    for name in names:
        block = layers[name] if isinstance(layers, nn.ModuleDict) else layers[int(name)]
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        if isinstance(layers, nn.ModuleDict):
            layers[name] = wrapped
        else:
            layers[int(name)] = wrapped
    return len(names)
