"""One optimizer step: micro-batches with gradient accumulation, autocast, clipping.

DDP all-reduces gradients in every backward unless told not to; `no_sync()` on all but the
last micro-batch makes accumulation cost one all-reduce per optimizer step. FSDP2 reduce-scatters
every micro-batch's gradients and accumulates the sharded ones, as torchtitan does: skipping the
reduce-scatter (`set_requires_gradient_sync(False)`) would hold the whole model's unsharded fp32
gradients until the last micro-batch (measured with `meshrun plan --simulate` on Llama 3 8B, FSDP 8,
4 micro-batches: a 57.2 GiB peak per rank instead of 31.0). HSDP leaves only the
all-reduce across replicas to the last micro-batch (`set_requires_all_reduce`), which costs no
memory. `train.sync_each_micro_batch = false` (`sync_each_micro_batch`) skips the reduce-scatter
instead, for fewer collectives (measured: tiny on 2 CPU processes with 4 micro-batches steps 1.21x
slower reducing each; `benchmarks/grad_accum.py`). Under context
parallel each micro-batch's forward and backward run inside `ContextParallel.step`, on this
rank's share of the sequence: its loss is the mean over its tokens, and every cp rank holds as
many, so FSDP's average over dp_shard x cp is the mean over every token. Under pipeline
parallel (`train_step_pp`) the schedule runs forward and backward of every micro-batch
itself, only the last stage sees the loss, and the grad norm combines the stages.

Masked data (chat / prompt-completion token directories: targets left out of the loss are -100,
cross entropy's ignore_index) is averaged over the trained tokens of the whole global batch: each
step first counts them over every micro-batch and every data-parallel rank (one all-reduce), then
each micro-batch's loss is its sum over its trained tokens / that count x the ranks the gradients
are averaged over. The result equals one process on the same global batch, however unevenly the
trained tokens fall on ranks and micro-batches (a mean of per-micro-batch means would not).
Pipeline parallel does the same inside the schedule's loss (`Pipeline.step(token_scale=...)`).
Unmasked data keeps the per-micro-batch mean / grad_accum, bit for bit as before.

Packed data (`data.packing`, meshrun.data.packing) comes as (inputs, targets, positions): the
positions restart at each example, and the model gets them with the examples' `documents`, so
attention stays inside each example. It is masked data (padding targets are -100), averaged as above.
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

from meshrun.data.packing import document_ids
from meshrun.data.tokens import IGNORE_INDEX
from meshrun.parallel.context import ContextParallel
from meshrun.parallel.layout import BuiltLayout
from meshrun.parallel.parallelize import clip_grad_norm_ as clip_dtensor_grad_norm_
from meshrun.train.precision import LossScaler, autocast_context


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
            positions: torch.Tensor | None = None, *, documents: torch.Tensor | None = None,
            reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy over the positions of the batch whose target is not IGNORE_INDEX:
    their mean, or their sum (reduction="sum"); `positions` are the columns' sequence positions
    when they are not 0..T-1 (context parallel, packed examples); `documents` (B, T): packed
    examples, attention kept inside each."""
    kwargs = {} if positions is None else {"positions": positions}
    if documents is not None:
        kwargs["documents"] = documents
    logits = model(inputs, **kwargs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def trained_token_scale(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, world_size: int,
                        dp_size: int, grad_ranks: int, device: torch.device | str = "cpu") -> float:
    """What a micro-batch's summed loss is multiplied by so that the gradients, once averaged over
    `grad_ranks` ranks (dp x cp), are those of the sum over the global batch / its trained tokens.

    One all-reduce over the world of this rank's trained-target count (0 batches: none); each dp
    rank's batch is held by world_size / dp_size ranks (tp, pp, cp), so that many copies are summed.
    `device`: where the count travels (the backend's: NCCL all-reduces only accelerator tensors).
    """
    count = sum(int((batch[1] != IGNORE_INDEX).sum()) for batch in micro_batches)
    if world_size > 1:
        import torch.distributed as dist

        total = torch.tensor([count], dtype=torch.float64, device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        count = round(float(total.item())) // (world_size // dp_size)
    return grad_ranks / max(count, 1)


def batch_on(batch: tuple, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, packed positions or None) of a loader's batch, on `device`."""
    inputs, targets, *packed = batch
    return (inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True),
            packed[0].to(device, non_blocking=True) if packed else None)


def packed_inputs(packed: torch.Tensor | None, positions: torch.Tensor | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(positions, documents) for the model: a packed batch's own positions and examples, or
    `positions` (context parallel's, or None) and no documents (context parallel refuses packing)."""
    if packed is None:
        return positions, None
    return packed, document_ids(packed)


def sequence_context(cp: ContextParallel | None, inputs: torch.Tensor, targets: torch.Tensor):
    """(inputs, targets, positions) of this rank: all of them, or its cp share with the ring on."""
    if cp is None:
        return contextlib.nullcontext((inputs, targets, None))
    return cp.step(inputs, targets)


def _loss_parallel_context(on: bool):
    """TP loss parallel: the logits stay vocab-sharded, so loss and backward run in torch's context."""
    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def mean_loss_across_ranks(value: torch.Tensor, world_size: int, pp: int = 1) -> float:
    """The loss every rank logs: this step's loss averaged over the data-parallel ranks.

    One all-reduce over the world. Ranks that do not see the loss (pipeline stages other than
    the last) pass 0; tp ranks of one stage hold the same value; cp ranks each the mean over
    their own, equally many, tokens. So the sum counts each dp rank's loss tp times over its cp
    shares, and world_size / pp = dp x cp x tp is the right divisor in every layout (plain world
    averaging, right for DDP/FSDP/TP/CP, would divide by pp too many).
    """
    if world_size > 1:
        import torch.distributed as dist

        value = value.detach().clone().float()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world_size // pp
    return float(value.item())


_NOT_COMPUTED = torch.tensor(float("nan"))  # the grad norm of a step that neither clips nor logs


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    grad_accum: int,
    device: torch.device,
    dtype: str,
    grad_clip: float,
    loss_parallel: bool = False,
    need_grad_norm: bool = True,
    scaler: LossScaler | None = None,
    context_parallel: ContextParallel | None = None,
    token_scale: float | None = None,
    sync_each_micro_batch: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Run `grad_accum` micro-batches and one optimizer step.

    token_scale: masked data's `trained_token_scale` for this step's batches (then each loss is
    the sum over trained tokens x token_scale); None: the mean / grad_accum.

    With a `scaler` (fp16) backward runs on the scaled loss, the gradients are unscaled before
    clipping, and a step whose gradients overflowed is skipped (the scaler counts it).

    Without clipping, the grad norm (a pass over every gradient, and a collective under
    FSDP/TP) is computed only when `need_grad_norm` (logging steps); otherwise it is NaN.

    Returns (mean loss, grad norm, forward seconds). The loss is this rank's (detached, not yet
    averaged across ranks): averaging costs a collective, so the caller does it only on logging
    steps. Forward time is this rank's own work, free of waiting on peers in the gradient
    all-reduce, which is what tells a straggler apart under DDP.
    """
    total = torch.zeros((), device=device)
    forward_s = 0.0
    for micro in range(grad_accum):
        inputs, targets, packed = batch_on(next(batches), device)
        last = micro == grad_accum - 1
        if hasattr(model, "set_requires_all_reduce"):  # FSDP2: see the module's docstring
            if sync_each_micro_batch:
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync, sequence_context(context_parallel, inputs, targets) as (inputs, targets, positions):
            started = time.perf_counter()
            positions, documents = packed_inputs(packed, positions)
            with _loss_parallel_context(loss_parallel):
                with autocast_context(device, dtype):
                    if token_scale is None:
                        loss = lm_loss(model, inputs, targets, positions, documents=documents) / grad_accum
                    else:
                        loss = lm_loss(model, inputs, targets, positions, documents=documents,
                                       reduction="sum") * token_scale
                forward_s += time.perf_counter() - started
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        total += loss.detach()
    max_norm = grad_clip if grad_clip > 0 else math.inf
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip <= 0 and not need_grad_norm:
        grad_norm = _NOT_COMPUTED
    elif any(isinstance(p, DTensor) for p in params):  # torch's clip rejects FSDP/TP's mixed meshes
        grad_norm = clip_dtensor_grad_norm_(params, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if scaler is not None:
        scaler.step(optimizer)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm, forward_s


def train_step_pp(
    pipeline,
    optimizers: list[torch.optim.Optimizer],
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    grad_accum: int,
    device: torch.device,
    dtype: str,
    grad_clip: float,
    pp_group,
    need_grad_norm: bool = True,
    context_parallel: ContextParallel | None = None,
    token_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`train_step` under pipeline parallel: `grad_accum` schedule steps, then every part's optimizer.
    `token_scale`: as in `train_step` (masked data).

    Every rank of a pipeline reads the same batch (they share a dp rank); the first stage
    consumes the inputs and the last the targets. The loss is 0 on ranks without the last
    stage (see `mean_loss_across_ranks`). The seconds returned are the schedule's, which under
    PP include waiting on neighbouring stages: forward and backward are interleaved in it.
    """
    total = torch.zeros((), device=device)
    started = time.perf_counter()
    for _ in range(grad_accum):
        inputs, targets, packed = batch_on(next(batches), device)
        with sequence_context(context_parallel, inputs, targets) as (inputs, targets, positions), \
                autocast_context(device, dtype):
            positions, documents = packed_inputs(packed, positions)
            total += pipeline.step(inputs, targets, positions=positions, documents=documents,
                                   token_scale=token_scale)
    step_s = time.perf_counter() - started
    params = [p for part in pipeline.parts for p in part.parameters() if p.grad is not None]
    if grad_clip <= 0 and not need_grad_norm:
        grad_norm = _NOT_COMPUTED
    else:
        grad_norm = clip_dtensor_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf, pp_group=pp_group)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return total, grad_norm, step_s


@torch.no_grad()
def evaluate_pp(pipeline, batches, *, steps: int, device: torch.device, dtype: str,
                context_parallel: ContextParallel | None = None) -> torch.Tensor:
    """`evaluate` through the pipeline, forward only (`schedule.eval`); 0 off the last stage.

    A last, smaller batch is skipped: it would not split into the schedule's micro-batches
    (every rank of a pipeline sees the same batches, so they all skip it).
    """
    for part in pipeline.parts:
        part.eval()
    total, count = torch.zeros((), device=device), 0
    full = None
    for i, batch in enumerate(batches):
        if i >= steps:
            break
        inputs, targets, packed = batch_on(batch, device)
        full = full or inputs.shape[0]
        if inputs.shape[0] != full:
            break
        split = sequence_context(context_parallel, inputs, targets)
        with split as (inputs, targets, positions), autocast_context(device, dtype):
            positions, documents = packed_inputs(packed, positions)
            total += pipeline.step(inputs, targets, train=False, positions=positions,
                                   documents=documents) * pipeline.grad_accum
        count += 1
    for part in pipeline.parts:
        part.train()
    return total / max(count, 1)


@torch.no_grad()
def evaluate(model: nn.Module, batches, *, steps: int, device: torch.device, dtype: str,
             loss_parallel: bool = False, context_parallel: ContextParallel | None = None,
             masked: bool = False) -> torch.Tensor:
    """Mean loss of this rank over up to `steps` held-out batches (caller averages across ranks);
    masked: [sum of the per-token losses, trained targets] of those batches instead (a batch, or a
    rank, may have none: `layout_evaluate` divides the sums over all ranks)."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for i, batch in enumerate(batches):
        if i >= steps:
            break
        inputs, targets, packed = batch_on(batch, device)
        split = sequence_context(context_parallel, inputs, targets)
        with split as (inputs, targets, positions), _loss_parallel_context(loss_parallel), \
                autocast_context(device, dtype):
            positions, documents = packed_inputs(packed, positions)
            loss = lm_loss(model, inputs, targets, positions, documents=documents,
                           reduction="sum" if masked else "mean")
        total += loss.full_tensor() if isinstance(loss, DTensor) else loss
        count += int((targets != IGNORE_INDEX).sum()) if masked else 1
    model.train(was_training)
    if masked:
        return torch.stack([total.float(), torch.tensor(float(count), device=device)])
    return total / max(count, 1)


Batches = Iterator[tuple[torch.Tensor, ...]]  # (inputs, targets), or (inputs, targets, positions) packed


def layout_step(layout: BuiltLayout, optimizers: list[torch.optim.Optimizer], batches: Batches, *,
                grad_accum: int, dtype: str, grad_clip: float, need_grad_norm: bool = True,
                scaler=None, masked: bool = False,
                sync_each_micro_batch: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step of a built layout over `grad_accum` micro-batches: (this rank's loss,
    grad norm, seconds), whatever the parallelism.

    masked: the data has a loss mask: the loss is averaged over the global batch's trained tokens
    (its micro-batches are read first, to count them).

    The loss is not yet averaged over the ranks (`layout_mean_loss`, a collective, does that).
    `scaler`: fp16's LossScaler (meshrun.train.precision); pipelines refuse fp16 (parallel/rules.py)."""
    common = dict(grad_accum=grad_accum, device=layout.device, dtype=dtype, grad_clip=grad_clip,
                  need_grad_norm=need_grad_norm)
    token_scale = None
    if masked:
        micro_batches = [next(batches) for _ in range(grad_accum)]
        cp = layout.context_parallel.degree if layout.context_parallel is not None else 1
        token_scale = trained_token_scale(micro_batches, world_size=layout.world_size, dp_size=layout.dp_size,
                                          grad_ranks=layout.dp_size * cp, device=layout.device)
        batches = iter(micro_batches)
    if layout.pipeline is not None:
        assert scaler is None, "fp16 under pp is refused by meshrun.parallel.rules.check_precision"
        return train_step_pp(layout.pipeline, optimizers, batches, pp_group=layout.pp_group,
                             context_parallel=layout.context_parallel, token_scale=token_scale, **common)
    return train_step(layout.parts[0], optimizers[0], batches, loss_parallel=layout.loss_parallel,
                      sync_each_micro_batch=sync_each_micro_batch, scaler=scaler, context_parallel=layout.context_parallel, token_scale=token_scale, **common)


def layout_evaluate(layout: BuiltLayout, batches, *, steps: int, dtype: str, masked: bool = False) -> float:
    """Mean held-out loss over up to `steps` batches, averaged over the ranks (every rank calls it).
    masked: over the trained targets of every rank's batches (under pp: the mean of the
    schedule's micro-batch means, each over its trained targets)."""
    if layout.pipeline is not None:
        local = evaluate_pp(layout.pipeline, batches, steps=steps, device=layout.device, dtype=dtype,
                            context_parallel=layout.context_parallel)
    else:
        local = evaluate(layout.parts[0], batches, steps=steps, device=layout.device, dtype=dtype,
                         loss_parallel=layout.loss_parallel, context_parallel=layout.context_parallel,
                         masked=masked)
        if masked:  # sum and count over the world: tp ranks repeat both, cp and dp ranks add their own
            if layout.world_size > 1:
                import torch.distributed as dist

                dist.all_reduce(local, op=dist.ReduceOp.SUM)
            return float(local[0] / local[1].clamp(min=1))
    return layout_mean_loss(layout, local)


def layout_mean_loss(layout: BuiltLayout, local: torch.Tensor) -> float:
    """This step's loss averaged over the data-parallel ranks: one all-reduce, on every rank."""
    return mean_loss_across_ranks(local, layout.world_size, layout.pp)
