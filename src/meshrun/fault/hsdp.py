"""HSDP replica groups under torchft: each group is an FSDP2 (`fully_shard`) group, and the groups
average their gradients through torchft's Manager.

    hsdp.attach(manager, model)        # replica.Replica, when the group's model is sharded
    state = hsdp.model_state(model, optimizer, sharded)   # what a healing peer's rank i receives ...
    hsdp.load_model_state(model, optimizer, state, sharded)  # ... and puts back into its own shards
    hsdp.weights_sum(model)            # the same fingerprint on every rank of the group

Gradients. FSDP reduce-scatters each block's gradients within the group (its default process
group) and averages them there; the all-reduce hook (`FSDPModule.set_all_reduce_hook`, called
on the reduce-scatter output, before FSDP writes the sharded `.grad`) then averages that shard
across the groups in the quorum with `Manager.allreduce`. Rank i of every group holds the same
shard (every group has the same mesh), so the same-local-rank processes that form torchft's
cross-group process group reduce matching data. The average is done when backward returns, so
gradient clipping sees the gradients every group has, as in torchtitan's FT HSDP (where the
managed replicate dimension does this inside FSDP). A failed cross-group all-reduce is recorded
by the Manager: the step is not committed and runs again (replica.py).

Heal. State dict and optimizer state values are DTensors, which the peer transport does not
carry (it reads weights-only): rank i sends its local shards, rank i of the healing group copies
them into its own DTensors and rebuilds the optimizer state (a fresh group's may be empty) as
DTensors on its parameters' mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def attach(manager, model: nn.Module) -> None:
    """Average every FSDP group's reduce-scattered gradients across the replica groups."""
    from torch.distributed.fsdp import FSDPModule

    def across_groups(reduce_output: torch.Tensor) -> None:
        manager.allreduce(reduce_output).wait()  # averages over the quorum's participants

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(across_groups)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> dict:
    """The model and optimizer state a healing peer receives; sharded, this rank's shards as plain
    tensors the transport carries."""
    if not sharded:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}
    optim = optimizer.state_dict()
    sharded = [[pid, key] for pid, s in optim["state"].items() for key, v in s.items() if isinstance(v, DTensor)]
    optim = {"state": {pid: {k: _local(v) for k, v in s.items()} for pid, s in optim["state"].items()},
             "param_groups": optim["param_groups"], "sharded": sharded}
    return {"model": {k: _local(v) for k, v in model.state_dict().items()}, "optim": optim}


@torch.no_grad()
def load_model_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict, sharded: bool) -> None:
    """Put a peer's `model_state` (sharded: from the peer's same local rank) into this rank's state."""
    if not sharded:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        return
    for name, t in model.state_dict().items():
        _local(t).copy_(saved["model"][name])
    optim = saved["optim"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {pid: dict(s) for pid, s in optim["state"].items()}
    for pid, key in optim["sharded"]:
        p = params[pid]
        state[pid][key] = DTensor.from_local(state[pid][key], p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())
    optimizer.load_state_dict({"state": state, "param_groups": optim["param_groups"]})


@torch.no_grad()
def weights_sum(model: nn.Module) -> float:
    """The float64 sum of every parameter and buffer, local shards summed over the group (a
    collective: every rank of the group calls it at the same step)."""
    local = sum((_local(t).detach().double().sum() for t in model.state_dict().values() if t.is_floating_point()),
                torch.zeros((), dtype=torch.float64))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local)
    return float(local)
