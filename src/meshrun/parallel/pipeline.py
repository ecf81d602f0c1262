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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.errors import ConfigError

# meshrun name -> (torch class name for get_schedule_class, several stages per rank).
# Left out, measured on torch 2.13 / gloo: ZBVZeroBubble trains right without data parallel but
# its `eval()` fails ("can't steal_bwd_input"), and DualPipeV needs overlapped F/B callbacks.
SCHEDULES: dict[str, tuple[str, bool]] = {
    "gpipe": ("GPipe", False),
    "1f1b": ("1F1B", False),
    "interleaved_1f1b": ("Interleaved1F1B", True),
    "looped_bfs": ("LoopedBFS", True),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", True),
}
# Zero bubble splits each backward into input and weight gradients; with fully_shard data
# parallel the losses drift from one process (3.8629 vs 3.8645 at step 2 here), so it is
# refused with dp > 1.
ZERO_BUBBLE = ("interleaved_zero_bubble",)


@dataclass(frozen=True)
class PipelinePlan:
    """What a pipeline layout is, resolved and checked before any process group exists."""

    schedule: str
    num_stages: int
    stages_per_rank: int
    microbatches: int
    layers: list[list[str]]
    """Block names (keys of model.layers) per stage, in stage order."""

    def stage_ids(self, pp_rank: int, pp: int) -> list[int]:
        """The stages this pipeline rank holds, in the order the schedule wants them."""
        return [pp_rank + k * pp for k in range(self.stages_per_rank)]


def plan_pipeline(*, pp: int, schedule: str, stages_per_rank: int, split_points: str,
                  n_layers: int, batch_size: int, microbatches: int, dp_size: int = 1) -> PipelinePlan:
    """Resolve and check a pipeline layout; every problem is one ConfigError naming the key.

    stages_per_rank 0 = 1 for single-stage schedules, 2 for the others. split_points '' =
    balanced (later stages take the remainder), else the first block of each stage after the
    first, e.g. '1' or 'layers.1' for pp=2. microbatches 0 = one per stage.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} is not supported; "
                          f"choose one of {', '.join(SCHEDULES)}")
    _, multi = SCHEDULES[schedule]
    if schedule in ZERO_BUBBLE and dp_size > 1:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} does not train correctly with data "
                          f"parallel ({dp_size} dp ranks) on torch 2.13; use 'interleaved_1f1b', "
                          "or give the ranks to parallel.pp / parallel.tp")
    per_rank = stages_per_rank or (2 if multi else 1)
    if multi and per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} interleaves several stages per rank, "
                          f"but parallel.pp_stages_per_rank={per_rank}; set it to 2 or more "
                          "(or 0 for 2), or use 'gpipe' / '1f1b'")
    if not multi and per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} runs one stage per rank, but "
                          f"parallel.pp_stages_per_rank={per_rank}; use 1 (or 0), or an interleaved "
                          "schedule such as 'interleaved_1f1b'")
    num_stages = pp * per_rank
    if num_stages > n_layers:
        raise ConfigError(f"parallel.pp={pp} x {per_rank} stages per rank = {num_stages} stages "
                          f"exceeds model.n_layers={n_layers} (a stage needs at least one block); "
                          f"use at most {n_layers} stages")
    layers = split_layers(n_layers, num_stages, split_points)
    n_micro = microbatches or num_stages
    if batch_size % n_micro:
        valid = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ConfigError(f"parallel.pp_microbatches={n_micro} does not divide train.batch_size="
                          f"{batch_size}; valid: {', '.join(map(str, valid))}")
    if schedule in ("1f1b",) and n_micro < num_stages:
        raise ConfigError(f"parallel.pp_schedule='1f1b' needs parallel.pp_microbatches >= the "
                          f"{num_stages} stages, got {n_micro}")
    rounds = max(1, n_micro // pp)  # torch's interleaved schedules run rounds of pp micro-batches
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and n_micro % rounds:
        raise ConfigError(f"parallel.pp_microbatches={n_micro} must be a multiple of parallel.pp={pp} "
                          f"(or at most {pp}) for {schedule!r}")
    return PipelinePlan(schedule, num_stages, per_rank, n_micro, layers)


def split_layers(n_layers: int, num_stages: int, split_points: str = "") -> list[list[str]]:
    """Block names per stage: balanced, or cut before each block index in `split_points`."""
    if not split_points.strip():
        # Stage s takes blocks [s*n/S, (s+1)*n/S): later stages get the remainder, the rule
        # `meshrun plan` counts memory with (meshrun.plan.show.stage_of_block).
        cuts = [s * n_layers // num_stages for s in range(1, num_stages)]
    else:
        cuts = []
        for item in split_points.split(","):
            text = item.strip().removeprefix("layers.")
            if not text.isdigit():
                raise ConfigError(f"parallel.pp_split_points={split_points!r}: {item.strip()!r} is not a "
                                  "block index; write e.g. '2' or 'layers.2,layers.5'")
            cuts.append(int(text))
        if len(cuts) != num_stages - 1:
            raise ConfigError(f"parallel.pp_split_points={split_points!r} gives {len(cuts) + 1} stages, "
                              f"but the layout has {num_stages}; list {num_stages - 1} block indices")
        if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= n_layers:
            raise ConfigError(f"parallel.pp_split_points={split_points!r} must be increasing block "
                              f"indices in 1..{n_layers - 1}, so every stage keeps a block")
    bounds = [0, *cuts, n_layers]
    return [[str(i) for i in range(bounds[s], bounds[s + 1])] for s in range(num_stages)]


def stage_module(model: nn.Module, stage_id: int, num_stages: int, layers: list[str], *,
                 in_place: bool = False) -> nn.Module:
    """`model` holding only `layers` (and the embedding / head if first / last stage).

    A copy of `model` (free when it lives on the meta device), or `model` itself, cut down, with
    `in_place`. Parameter names are the original ones. Tied embeddings are refused: the two ends
    would hold separate copies and drift apart.
    """
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        raise ConfigError("pipeline parallel with model.tie_embeddings=true would split the shared "
                          "matrix between the first and last stage; set model.tie_embeddings=false")
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
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / scale

    return loss_fn


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""

    schedule: object
    stages: list
    parts: list[nn.Module]
    plan: PipelinePlan
    grad_accum: int = 1

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool = True) -> torch.Tensor:
        """One schedule step over a whole (per dp rank) batch; returns the batch's mean loss /
        grad_accum on the rank holding the last stage and 0 elsewhere (detached)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last else {}
        if train:
            self.schedule.step(*args, **kwargs)
        else:
            self.schedule.eval(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()  # each is 1/n of the mean


def build_pipeline(model: nn.Module, plan: PipelinePlan, pp_mesh, *, device: torch.device,
                   parallelize_part, grad_accum: int = 1) -> Pipeline:
    """Split `model` as `plan` says (it is cut down in place: this rank's last stage), parallelize
    each stage (`parallelize_part(module)` does tp -> AC -> fsdp -> materialise -> ddp), wrap them
    in PipelineStages over `pp_mesh` and build the schedule."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    stages, parts = [], []
    stage_ids = plan.stage_ids(pp_rank, pp)
    modules = [stage_module(model, stage_id, plan.num_stages, plan.layers[stage_id],
                            in_place=stage_id == stage_ids[-1]) for stage_id in stage_ids]
    for stage_id, module in zip(stage_ids, modules, strict=True):
        part = parallelize_part(module)
        parts.append(part)
        stages.append(PipelineStage(part, stage_id, plan.num_stages, device, group=pp_mesh.get_group()))
    cls = get_schedule_class(SCHEDULES[plan.schedule][0])
    loss_fn = lm_loss_fn(plan.microbatches * grad_accum)
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(schedule, stages, parts, plan, grad_accum)

