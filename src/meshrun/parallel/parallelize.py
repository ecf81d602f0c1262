"""The one place that decides the order: pp split -> tp -> activation checkpointing -> fsdp
-> materialise -> ddp.

Three entries, each taking a model that may still live on the meta device:
- `parallelize(model, parallel_cfg, device=, world_size=)`: plain DDP over the whole world (no
  DeviceMesh).
- `parallelize_nd(model, dims, mesh, device=, ...)`: any combination of DDP, FSDP2, HSDP and TP
  over one DeviceMesh built by `ParallelDims.build_mesh`.
- `parallelize_pipeline(model, dims, mesh, plan, device=, ...)`: the same with pp > 1: the model
  is split into stages first and each stage gets tp -> AC -> fsdp -> materialise -> ddp (3-D
  and more).

`materialize(module)`, when given, is called on each module once it is sharded and before any
DDP wrap: it allocates only this rank's shards (`to_empty`) and fills them (`init_weights`), so
no rank ever holds the whole model (meshrun.parallel.layout.materialize). DDP comes after it
because its constructor broadcasts rank 0's real weights.

Why this order (torchtitan's, torchtitan/models/llama3/infra/parallelize.py): TP rewrites the
linear layers' parameters into DTensors on the tp axis, so it must see the plain modules;
activation checkpointing wraps whole blocks, TP'd or not; FSDP comes last so that it shards the
final (possibly TP'd, possibly wrapped) parameters, composing tp and dp into 2-D DTensors.
The optimizer must be built after all of this (FSDP replaces the parameters, and `to_empty`
replaces every tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshrun.errors import ConfigError
from meshrun.parallel.checkpointing import apply_activation_checkpointing
from meshrun.parallel.ddp import apply_ddp
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.rules import check_experts_found, check_tp_features

if TYPE_CHECKING:
    from meshrun.parallel.pipeline import Pipeline


def parallelize(
    model: nn.Module,
    parallel_cfg,
    *,
    device: torch.device,
    world_size: int,
    activation_checkpointing: bool = False,
    materialize: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Wrap `model` for the current world as `parallel_cfg` says (DDP); `materialize` runs
    before the wrap (a meta-built model gets its real weights there)."""
    strategy = getattr(parallel_cfg, "strategy", "ddp")
    if strategy != "ddp":
        raise ConfigError(f"parallel.strategy={strategy!r} needs a DeviceMesh: build one with "
                          f"ParallelDims.build_mesh and call parallelize_nd")
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if materialize is not None:
        materialize(model)
    if world_size > 1:
        model = apply_ddp(model, device)
    return model


def parallelize_nd(
    model: nn.Module,
    dims: ParallelDims,
    mesh,
    *,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    materialize: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply tp -> activation checkpointing -> fsdp -> materialize -> ddp to `model` as `dims` says.

    Data parallel is chosen from the degrees, as torchtitan does: dp_shard > 1 gives FSDP2
    (HSDP with dp_replicate > 1 as well); TP with dp_replicate > 1 only also goes through
    fully_shard, on the (dp_replicate, dp_shard=1) mesh, because DDP does not take DTensor
    parameters; plain DDP is left for dp_replicate > 1 alone. param_dtype, reduce_dtype,
    reshard_after_forward and cpu_offload are FSDP's (see `apply_fsdp`); sequence_parallel and
    loss_parallel are TP's (see `apply_tp`). Returns the model to train (DDP wraps; the others
    work in place). Build the optimizer on the returned model's parameters afterwards.
    """
    if dims.pp_enabled:
        raise ConfigError(f"parallel.pp={dims.pp}: a pipeline needs parallelize_pipeline, which "
                          "splits the model into stages before parallelizing each")
    return _apply_nd(model, dims, mesh, device=device, param_dtype=param_dtype,
                     reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward,
                     cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing,
                     sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                     materialize=materialize)


def parallelize_pipeline(model: nn.Module, dims: ParallelDims, mesh, plan, *, device: torch.device,
                         grad_accum: int = 1, **options) -> Pipeline:
    """pp split -> (tp -> activation checkpointing -> fsdp -> materialize -> ddp) on each stage -> the schedule.

    `plan` is a `ResolvedPipeline` (`resolve_pipeline`); `options` are `parallelize_nd`'s keywords.
    Sequence and loss parallel are refused: they make a stage's output a DTensor, which the
    pipeline's point-to-point sends do not carry.
    """
    from meshrun.parallel.pipeline import build_pipeline

    check_tp_features(dims.tp, dims.pp, bool(options.get("sequence_parallel")), bool(options.get("loss_parallel")))
    return build_pipeline(model, plan, mesh["pp"], device=device, grad_accum=grad_accum,
                          parallelize_part=lambda part: _apply_nd(part, dims, mesh, device=device, **options))


def _apply_nd(model: nn.Module, dims: ParallelDims, mesh, *, device: torch.device,
              param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
              reshard_after_forward: bool = True, cpu_offload: bool = False,
              activation_checkpointing: bool = False, sequence_parallel: bool = False,
              loss_parallel: bool = False,
              materialize: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """tp -> activation checkpointing -> fsdp -> materialize -> ddp on one module (a whole model
    or a pp stage)."""
    check_tp_features(dims.tp, dims.pp, sequence_parallel, loss_parallel)
    if dims.tp_enabled:
        from dataclasses import asdict

        from meshrun.parallel.resolve import ModelShape
        from meshrun.parallel.tp import apply_tp

        dims.check_model(**asdict(ModelShape.from_model(model)))  # a ConfigError, not a shape error
        apply_tp(model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if dims.ep_enabled:
        from meshrun.parallel.expert_parallel import apply_ep, expert_modules

        # A pipeline stage may hold no MoE block; the whole model must have some.
        check_experts_found(dims.ep, len(list(expert_modules(model))) or _stage_may_lack(model))
        apply_ep(model, dims.ep_mesh(mesh))
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    # DDP takes neither DTensor parameters (TP) nor a pipeline's several backwards per step
    # (its reducer asserts when it rebuilds buckets, measured on torch 2.13): replicate with
    # fully_shard on the (dp_replicate, dp_shard=1) mesh instead, as torchtitan does.
    # Context parallel ranks shard with the dp_shard ranks (FSDP over "dp_shard_cp", torchtitan's
    # fold): each holds other tokens of the same samples, so their gradients are averaged too.
    use_fsdp = dims.fsdp_enabled or ((dims.tp_enabled or dims.pp_enabled) and dims.dp_replicate_enabled)
    if use_fsdp:
        from meshrun.parallel.fsdp import ExpertSharding, apply_fsdp

        experts = None
        if dims.ep_enabled:  # the experts sharded over the dp_shard ranks ep leaves (torchtitan's efsdp)
            experts = ExpertSharding(dims.expert_fsdp_mesh(mesh), grad_divide=dims.dp_size)
        model = apply_fsdp(model, dims.fsdp_mesh(mesh) if dims.fsdp_enabled
                           else mesh["dp_replicate", "dp_shard"],
                           param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                           experts=experts)
    if materialize is not None:
        materialize(model)
    if dims.dp_replicate_enabled and not use_fsdp:
        model = apply_ddp(model, device, process_group=mesh["dp_replicate"].get_group())
    return model


def _stage_may_lack(model: nn.Module) -> bool:
    """A pipeline stage (its blocks a slice of the model's) may hold only dense blocks."""
    args = getattr(model, "args", None)
    return bool(getattr(args, "experts", 0)) and len(getattr(model, "layers", ())) < getattr(args, "n_layers", 0)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (`.module`), for saving and inspection (FSDP/TP work in place)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain, full CPU tensors of every parameter and buffer, in `unwrap_model`'s key names.

    Call it on every rank: with FSDP/TP it gathers the shards (a collective), and rank 0 gets
    the tensors (other ranks get {}). Without DTensors it is a local copy. Uses
    torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True,
    cpu_offload=True), https://docs.pytorch.org/docs/stable/distributed.checkpoint.html
    """
    inner = unwrap_model(model)
    if not _has_dtensors(inner):
        if dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(inner, options=options)


def clip_grad_norm_(parameters, max_norm: float, *, pp_group=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ that also works when gradients are DTensors on different meshes.

    Under FSDP + TP, the TP'd weights are 2-D (dp, tp) DTensors while the norms are 1-D (dp);
    under TP alone, the norms are plain tensors next to DTensor weights. torch's version fails
    on both ("got mixed torch.Tensor and DTensor", measured on torch 2.13). Here each group's norm is made a plain full
    value (`full_tensor`, a collective on every rank alike) before they are combined, as
    torchtitan's `clip_grad_norm_` does. With `pp_group` (pipeline parallel: each rank holds
    only its stages' parameters) the stages' norms are combined over that group, as torchtitan
    does; every rank of the group must call it. Returns the total norm as a plain scalar tensor.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if pp_group is not None:
        # Each pipeline stage holds other parameters: the global norm combines the stages' squares.
        total = total.float() ** 2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    if not grads:
        return total
    if math.isfinite(max_norm):
        # Scale the local shards: elementwise, so it is the same as scaling the global tensors,
        # and it avoids mixing the plain coefficient with DTensors (which DTensor refuses).
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total


def _has_dtensors(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
