"""One optimizer step: micro-batches with gradient accumulation, autocast, clipping.

DDP all-reduces gradients in every backward unless told not to; `no_sync()` on all but the
last micro-batch makes accumulation cost one all-reduce per optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.parallel.parallelize import clip_grad_norm_ as clip_dtensor_grad_norm_

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast on any device (CPU included); fp32 runs without autocast."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the batch."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    grad_accum: int,
    device: torch.device,
    dtype: str,
    grad_clip: float,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Run `grad_accum` micro-batches and one optimizer step.

    Returns (mean loss, grad norm, forward seconds). The loss is this rank's (detached, not yet
    averaged across ranks): averaging costs a collective, so the caller does it only on logging
    steps. Forward time is this rank's own work, free of waiting on peers in the gradient
    all-reduce, which is what tells a straggler apart under DDP.
    """
    total = torch.zeros((), device=device)
    forward_s = 0.0
    for micro in range(grad_accum):
        inputs, targets = next(batches)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        last = micro == grad_accum - 1
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last only
            model.set_requires_gradient_sync(last)
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            started = time.perf_counter()
            with autocast_context(device, dtype):
                loss = lm_loss(model, inputs, targets) / grad_accum
            forward_s += time.perf_counter() - started
            loss.backward()
        total += loss.detach()
    max_norm = grad_clip if grad_clip > 0 else math.inf
    params = [p for p in model.parameters() if p.grad is not None]
    if any(isinstance(p, DTensor) for p in params):  # torch's clip rejects FSDP/TP's mixed meshes
        grad_norm = clip_dtensor_grad_norm_(params, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm, forward_s


@torch.no_grad()
def evaluate(model: nn.Module, batches, *, steps: int, device: torch.device, dtype: str) -> torch.Tensor:
    """Mean loss of this rank over up to `steps` held-out batches (caller averages across ranks)."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for i, (inputs, targets) in enumerate(batches):
        if i >= steps:
            break
        with autocast_context(device, dtype):
            total += lm_loss(model, inputs.to(device), targets.to(device))
        count += 1
    model.train(was_training)
    return total / max(count, 1)
