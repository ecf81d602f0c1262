"""Pipeline parallel for the built-in Transformer: split by blocks into stages, run a torch schedule.

Technique: GPipe (Huang et al., arXiv:1811.06965), 1F1B (PipeDream-Flush, Narayanan et al.,
arXiv:2006.09503), interleaved 1F1B (Megatron-LM, arXiv:2104.04473), zero bubble (Qi et al.,
arXiv:2401.10241). Everything runs on `torch.distributed.pipelining` (`PipelineStage` and its
schedules, https://docs.pytorch.org/docs/stable/distributed.pipelining.html); the stage split
follows torchtitan's `pipeline_module_split` (torchtitan/distributed/pipeline_parallel.py).

A stage is the model with the blocks (and embedding / final norm / output) it does not own
deleted, so every parameter keeps its original name (`layers.3.attention.wq.weight` is called
that on whichever rank holds block 3): checkpoints and the optimizer state are keyed the same in
every layout. The trainer builds the model on the meta device, so the split holds no weights:
a rank's last stage is cut from the model itself, its other stages (interleaved schedules) from
copies of the meta model, which cost no storage, and only then is each stage materialised.

Which schedules: the ones below were run here on CPU/gloo against one process (tests/e2e/
test_parallel_matrix.py). "Single" schedules hold one stage per rank; the others hold
`stages_per_rank` (>= 2) stages, looped: rank r holds stages r, r + pp, ...
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.errors import ConfigError
from meshrun.parallel.rules import check_tied_pipeline
from meshrun.parallel.rules_pp import (
    SCHEDULES,
    ResolvedPipeline,
    resolve_pipeline,  # noqa: F401 (re-exported; meshrun.parallel.rules_pp owns the pipeline rules)
    split_layers,  # noqa: F401
)

# torch's schedule also runs each stage's forward outside any micro-batch, to infer the shapes it
# sends (on the first step, and on the first after an eval). A model that keeps per-step
# statistics (meshrun.models.moe) counts only the micro-batches' forwards: forward_is_step_work.
_STEP_WORK: ContextVar[bool] = ContextVar("meshrun_step_work", default=True)
# Masked data: what each micro-batch's summed loss is multiplied by during one `Pipeline.step`
# (None: the mean / micro-batches x grad_accum).
_TOKEN_SCALE: ContextVar[float | None] = ContextVar("meshrun_token_scale", default=None)


def forward_is_step_work() -> bool:
    """False while a pipeline schedule runs a forward that is not a micro-batch's; True outside
    pipelines."""
    return _STEP_WORK.get()


@functools.cache
def _micro_batch_stage_class():
    """PipelineStage that marks its micro-batch forwards as step work (torch imported lazily)."""
    from torch.distributed.pipelining import PipelineStage

    class MicroBatchStage(PipelineStage):
        def forward_one_chunk(self, *args, **kwargs):
            token = _STEP_WORK.set(True)
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                _STEP_WORK.reset(token)

    return MicroBatchStage


def stage_module(model: nn.Module, stage_id: int, num_stages: int, layers: list[str], *,
                 in_place: bool = False) -> nn.Module:
    """`model` holding only `layers` (and the embedding / head if first / last stage).

    A copy of `model` (free when it lives on the meta device), or `model` itself, cut down, with
    `in_place`. Parameter names are the original ones. Tied embeddings are refused: the two ends
    would hold separate copies and drift apart.
    """
    check_tied_pipeline(getattr(getattr(model, "args", None), "tie_embeddings", False))
    for attr in ("layers", "tok_embeddings", "norm", "output"):
        if not hasattr(model, attr):
            raise ConfigError(f"pipeline parallel needs the built-in Transformer layout; "
                              f"{type(model).__name__} has no `{attr}` (see meshrun.models.llama)")
    stage = model if in_place else copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if name not in layers:
            del stage.layers[name]
    if stage_id != 0:
        stage.tok_embeddings = None
        if getattr(stage, "input_parts", None) is not None:  # the HF adapter's (GPT-2's wpe): the first stage's
            stage.input_parts = None
    if stage_id != num_stages - 1:
        stage.norm = None
        stage.output = None
    return stage


def lm_loss_fn(scale: int = 1):
    """The schedule's loss: next-token cross entropy of one micro-batch, divided by `scale`
    (micro-batches x grad_accum), so that the accumulated gradients are the batch mean.

    Not torch's `scale_grads=True`: it divides every `.grad` after each schedule step, which
    also shrinks what earlier steps of a gradient accumulation left there (measured: grad norm
    0.755 instead of 0.998 with grad_accum=2).
    """

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        token_scale = _TOKEN_SCALE.get()
        if token_scale is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / scale
        # masked data: the sum over trained targets (ignore_index -100) x the step's scale (meshrun.train.step)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") * token_scale

    return loss_fn


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""

    schedule: object
    stages: list
    parts: list[nn.Module]
    plan: ResolvedPipeline
    grad_accum: int = 1
    parallelize_part: Callable[[nn.Module], nn.Module] | None = None
    """What made each stage's part from its module; a simulated rank makes its probe alike
    (meshrun.train.simulate_pipeline)."""

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool = True,
             positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
             token_scale: float | None = None) -> torch.Tensor:
        """One schedule step over a whole (per dp rank) batch; returns the batch's mean loss /
        grad_accum on the rank holding the last stage and 0 elsewhere (detached).

        `token_scale` (masked data): each micro-batch's loss is its sum over trained targets x
        token_scale instead (meshrun.train.step.trained_token_scale), and so is what is returned.

        `positions` (T,) or (B, T): the sequence positions of the columns (context parallel's
        share, or packed examples'). Every stage's forward gets them, one row per sample, split into
        micro-batches with the batch; so does it `documents` (B, T), packed examples' indices."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        kwargs: dict = {"target": targets, "losses": losses} if self.is_last else {}
        if positions is not None:
            kwargs["positions"] = positions.expand(inputs.shape[0], -1)
        if documents is not None:
            kwargs["documents"] = documents
        token = _STEP_WORK.set(False)  # only the micro-batches' forwards are (MicroBatchStage)
        scale_token = _TOKEN_SCALE.set(token_scale)
        try:
            if train:
                self.schedule.step(*args, **kwargs)
            else:
                self.schedule.eval(*args, **kwargs)
        finally:
            _TOKEN_SCALE.reset(scale_token)
            _STEP_WORK.reset(token)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()  # each is 1/n of the mean


def build_pipeline(model: nn.Module, plan: ResolvedPipeline, pp_mesh, *, device: torch.device,
                   parallelize_part, grad_accum: int = 1) -> Pipeline:
    """Split `model` as `plan` says (it is cut down in place: this rank's last stage), parallelize
    each stage (`parallelize_part(module)` does tp -> AC -> fsdp -> materialise -> ddp), wrap them
    in PipelineStages over `pp_mesh` and build the schedule."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    stages, parts = [], []
    stage_ids = plan.stage_ids(pp_rank, pp)
    modules = [stage_module(model, stage_id, plan.num_stages, plan.layers[stage_id],
                            in_place=stage_id == stage_ids[-1]) for stage_id in stage_ids]
    for stage_id, module in zip(stage_ids, modules, strict=True):
        part = parallelize_part(module)
        parts.append(part)
        stages.append(_micro_batch_stage_class()(part, stage_id, plan.num_stages, device,
                                                 group=pp_mesh.get_group()))
    cls = get_schedule_class(SCHEDULES[plan.schedule][0])
    loss_fn = lm_loss_fn(plan.microbatches * grad_accum)
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(schedule, stages, parts, plan, grad_accum, parallelize_part)

