"""FSDP2 misuse the guide warns about: an optimizer built before `fully_shard`.

`fully_shard` replaces each parameter with a new DTensor parameter, so an optimizer built before
it holds the old tensors: they never get a gradient and `step()` silently changes nothing (on
torch 2.13 the parameters never move, and no error is raised). `check_optimizer(model,
optimizer)` says so up front; while the launcher's debug tools are on (the hang watchdog is, by
default), every optimizer's first step is checked too (no gradient on any of its parameters),
which catches the same mistake without the model at hand.
"""

from __future__ import annotations

import sys

from meshrun.errors import MeshrunError


class OptimizerMisuseError(MeshrunError):
    """The optimizer does not hold the model's parameters."""

    meshrun_diagnosis = True


ADVICE = ("build the optimizer after fully_shard / DDP / parallelize, from the wrapped model's parameters: "
          "optimizer = torch.optim.AdamW(model.parameters())")


def check_optimizer(model, optimizer) -> None:
    """Raise when `optimizer` holds none (or only some) of `model`'s current parameters."""
    model_ids = {id(p) for p in model.parameters()}
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    stale = [p for p in opt_params if id(p) not in model_ids]
    if not stale:
        return
    sharded = any(type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"
                  for p in model.parameters())
    why = ("the model was sharded with fully_shard after the optimizer was built, so the optimizer holds the "
           "old tensors and step() is a silent no-op" if sharded else
           "the optimizer holds tensors that are no longer the model's parameters")
    raise OptimizerMisuseError(f"{len(stale)} of the optimizer's {len(opt_params)} parameters are not the model's: "
                               f"{why}; {ADVICE}")


def first_step_check(optimizer, args, kwargs) -> None:  # noqa: ARG001 - torch's step pre-hook signature
    """A global step pre-hook: on an optimizer's first step, warn when no parameter has a gradient."""
    if getattr(optimizer, "_meshrun_step_checked", False):
        return
    optimizer._meshrun_step_checked = True
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if params and all(p.grad is None for p in params):
        print(f"meshrun: warning: {type(optimizer).__name__}.step() found no gradient on any of its {len(params)} "
              f"parameters, so it changes nothing. Built before fully_shard? {ADVICE}", file=sys.stderr, flush=True)
