"""FSDP2 (`fully_shard`): shard parameters, gradients and optimizer state over the data-parallel ranks.

Technique: "PyTorch FSDP" (Zhao et al., arXiv:2304.11277), in its per-parameter DTensor form
(FSDP2, https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html); the wrapping
follows torchtitan's `apply_fsdp` (torchtitan/models/llama3/infra/parallelize.py).

Three contracts the guide states only partly, all measured on CPU/gloo here:
- Bottom-up: each block first, then the root. Each `fully_shard` call makes one communication
  unit (one all-gather before its forward, one reduce-scatter after its backward), so wrapping
  only the root would gather the whole model at once with nothing to overlap. No new process
  group is created per call (the guide says there is); all units use the mesh's groups.
- Build the optimizer after `fully_shard`: it replaces each parameter with a sharded DTensor,
  so an optimizer built before holds the old tensors and silently never updates the model.
- Call `model(x)`, never `model.forward(x)`: the all-gather runs in a forward pre-hook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks in `model.layers` (ModuleDict or ModuleList), in order; [] if none."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    return []


@dataclass(frozen=True)
class ExpertSharding:
    """How expert parallel's routed experts are sharded (meshrun.parallel.expert_parallel):
    over `mesh` (the dp_shard ranks holding the same experts, "efsdp"), their gradient divided by
    `grad_divide` (every data-parallel rank's tokens reach them, not only efsdp's)."""

    mesh: DeviceMesh
    grad_divide: int


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    experts: ExpertSharding | None = None,
) -> nn.Module:
    """Shard `model` in place over `mesh` and return it (now also an `FSDPModule`).

    mesh: 1-D = FSDP (parameters Shard(0) over it); 2-D (dp_replicate, dp_shard) = HSDP
    (Replicate over the first axis, Shard(0) over the second): gradients are reduce-scattered
    within a shard group and all-reduced across replicas, as torch's fully_shard documents.
    param_dtype: the dtype parameters are all-gathered in and compute runs in (None = as stored,
    fp32); the sharded master copy and the optimizer stay in the stored dtype.
    reduce_dtype: the dtype of the gradient reduce-scatter (None = param_dtype); fp32 with a
    bf16 param_dtype keeps the sum exact across ranks.
    reshard_after_forward: free each block's gathered parameters after its forward and gather
    again in backward (less memory, one more all-gather). The root is left to torch's default
    (kept gathered), since backward starts with it.
    cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (only
    useful with an accelerator; on CPU it is accepted and changes nothing).

    When tensor parallel was applied first, parameters are already DTensors on the tp mesh and
    fully_shard composes them into 2-D (dp, tp) DTensors: FSDP + TP needs no other change.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload:
        # Pinned host memory needs an accelerator; CPU training has nothing to pin.
        offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    for block in blocks_of(model):
        if experts is not None:
            _shard_experts(block, experts, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                           offload_policy=offload)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp, offload_policy=offload)
    # The root unit holds what is left: embeddings, the final norm and the output projection.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def _shard_experts(block: nn.Module, experts: ExpertSharding, **kwargs) -> None:
    """Each grouped-experts module of `block` its own FSDP unit over the experts' mesh, before the
    block's unit (which then leaves their parameters alone), as torchtitan does.

    The expert gradient on an ep rank already sums the losses of its ep peers' tokens, so FSDP
    divides by the whole data-parallel size instead of the experts' mesh size. Over more than
    one rank the reduction is a plain sum then that division (gloo has no pre-multiplied sum);
    over one rank torch divides by the factor itself (forcing the sum there would divide twice,
    torch 2.13's foreach_reduce).
    """
    from meshrun.parallel.expert_parallel import expert_modules

    for module in list(expert_modules(block)):
        fully_shard(module, mesh=experts.mesh, **kwargs)
        module.set_gradient_divide_factor(float(experts.grad_divide))
        if experts.mesh.mesh.shape[-1] > 1:  # efsdp, the shard dim (after dp_replicate under HSDP)
            module.set_force_sum_reduction_for_comms(True)


def sharded_bytes(model: nn.Module) -> int:
    """Bytes of this rank's local parameter shards (what FSDP keeps resident between steps)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total
