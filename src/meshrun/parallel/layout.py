"""From the `[parallel]` section to what the trainer holds: model parts, a pipeline, dp rank and size.

    layout = build_layout(model, cfg.parallel, device=env.device, world_size=env.world_size,
                          train_cfg=cfg.train)
    layout.parts          # one module per pipeline stage on this rank (one without PP)
    layout.pipeline       # the schedule driver under PP, else None
    layout.dp_rank, layout.dp_size, layout.pp

`strategy = "ddp"` with pp = 1 is the plain DDP path (no DeviceMesh); everything else goes over
one DeviceMesh: `parallelize_nd`, or `parallelize_pipeline` when pp > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.parallelize import (
    _has_dtensors,
    full_state_dict,
    parallelize,
    parallelize_nd,
    parallelize_pipeline,
    unwrap_model,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Layout:
    """This rank's share of the model and where it sits among the ranks."""

    parts: list[nn.Module]
    dp_rank: int
    dp_size: int
    pipeline: object | None = None
    dims: ParallelDims | None = None
    mesh: object | None = None
    loss_parallel: bool = False

    @property
    def pp(self) -> int:
        return self.dims.pp if self.dims is not None else 1

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group() if self.pipeline is not None else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full plain CPU tensors of the whole model on rank 0 ({} elsewhere); every rank calls it.

        Under PP each stage's first (dp 0, tp 0) rank sends its parts' full tensors to rank 0
        (gather_object); the original parameter names make the merge a dict update.
        """
        if self.pipeline is None:
            model = self.parts[0]
            if _has_dtensors(model) or not dist.is_initialized() or dist.get_rank() == 0:
                return full_state_dict(model)
            return {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state: dict[str, torch.Tensor] = {}
        for part in self.parts:  # collectives within the stage's dp/tp ranks, on all of them
            full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state.update({k: v.detach().cpu().clone() for k, v in full.items()})
        sender = self.dp_rank == 0 and self.mesh["tp"].get_local_rank() == 0
        gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state if sender else {}, gathered, dst=0)
        if gathered is None:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for piece in gathered:
            merged.update(piece or {})
        return merged


def build_layout(model: nn.Module, parallel_cfg, *, device: torch.device, world_size: int,
                 train_cfg) -> Layout:
    """Wrap `model` (on `device`, the same on every rank) as `parallel_cfg` says; see the module doc."""
    pcfg = parallel_cfg
    if pcfg.strategy == "ddp" and pcfg.pp == 1:
        wrapped = parallelize(model, pcfg, device=device, world_size=world_size,
                              activation_checkpointing=train_cfg.activation_checkpointing)
        return Layout([wrapped], dp_rank=dist.get_rank() if world_size > 1 else 0, dp_size=world_size)
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.check_model_args(getattr(model, "args", None))
    plan = pipeline_plan(pcfg, dims, train_cfg, model) if dims.pp_enabled else None
    mesh = dims.build_mesh(device.type)
    options = dict(
        param_dtype=DTYPES[train_cfg.dtype if pcfg.param_dtype == "auto" else pcfg.param_dtype],
        reduce_dtype=DTYPES[pcfg.reduce_dtype],
        reshard_after_forward=pcfg.fsdp_reshard_after_forward,
        cpu_offload=pcfg.fsdp_cpu_offload,
        activation_checkpointing=train_cfg.activation_checkpointing,
        sequence_parallel=pcfg.sequence_parallel,
        loss_parallel=pcfg.loss_parallel,
    )
    layout = Layout([], dp_rank=dims.dp_rank(mesh), dp_size=dims.dp_size, dims=dims, mesh=mesh,
                    loss_parallel=pcfg.loss_parallel)
    if plan is None:
        layout.parts = [parallelize_nd(model, dims, mesh, device=device, **options)]
    else:
        layout.pipeline = parallelize_pipeline(model, dims, mesh, plan, device=device,
                                               grad_accum=train_cfg.grad_accum, **options)
        layout.parts = layout.pipeline.parts
    return layout


def pipeline_plan(pcfg, dims: ParallelDims, train_cfg, model: nn.Module | None = None, *,
                  n_layers: int | None = None):
    """The checked `PipelinePlan` for this config (preflight calls it with `n_layers` alone)."""
    from meshrun.parallel.pipeline import plan_pipeline

    if n_layers is None:
        n_layers = len(getattr(unwrap_model(model), "layers", []))
    return plan_pipeline(pp=dims.pp, schedule=pcfg.pp_schedule, stages_per_rank=pcfg.pp_stages_per_rank,
                         split_points=pcfg.pp_split_points, n_layers=n_layers,
                         batch_size=train_cfg.batch_size, microbatches=pcfg.pp_microbatches,
                         dp_size=dims.dp_size)
