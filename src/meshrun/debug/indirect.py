"""Collectives torch issues for the user, shown to `--debug collectives`: DDP buckets, DTensor's.

Two paths bypass torch.distributed's Python functions that collectives.py wraps:
- DDP's C++ reducer all-reduces each gradient bucket through the process group directly. At a
  DDP model's first forward, if nobody has registered a communication hook, this registers
  torch's own `allreduce_hook` (ddp_comm_hooks/default_hooks.py: divide by the world size, then
  `dist.all_reduce` the bucket) with `register_comm_hook`, the reducer's documented extension
  point: the same arithmetic, now through the wrapped `dist.all_reduce`. Each bucket is then
  fingerprinted (float32[numel]) at the user's `backward()` line, labelled with its bucket index.
  A model with its own Python hook already goes through `dist.*`; a built-in C++ hook
  (`_register_builtin_comm_hook`) stays unseen, and so does a DDP model inside torch.compile
  (its first forward is traced, not run: no hook is registered then).
- DTensor redistributions (and DDP under compiled autograd) call
  `torch.distributed._functional_collectives` (funcol), whose ops run in C++. Its Python
  functions are wrapped like torch.distributed's and fingerprinted under the c10d op they perform
  (all_gather_single -> all_gather_into_tensor), counted on the same group as `dist.*` calls.
Nothing here runs unless `--debug collectives` is on; `CollectivePatch.uninstall()` undoes it.
"""

from __future__ import annotations

import functools

# funcol function -> (the c10d op it fingerprints as, position of its group, position of the
# tensor every rank must agree on, or None: per-rank split sizes make shapes legitimately differ)
FUNCOL_OPS: dict[str, tuple[str, int, int | None]] = {
    "all_reduce": ("all_reduce", 2, 0),
    "broadcast": ("broadcast", 2, 0),
    "all_gather_tensor": ("all_gather_into_tensor", 2, 0),
    "all_gather_tensor_autograd": ("all_gather_into_tensor", 2, 0),
    "all_gather_single": ("all_gather_into_tensor", 2, 0),
    "all_gather_single_autograd": ("all_gather_into_tensor", 2, 0),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 3, 0),
    "reduce_scatter_tensor_autograd": ("reduce_scatter_tensor", 3, 0),
    "reduce_scatter_single": ("reduce_scatter_tensor", 3, 0),
    "reduce_scatter_single_autograd": ("reduce_scatter_tensor", 3, 0),
    "all_reduce_coalesced": ("all_reduce_coalesced", 2, 0),
    "all_gather_single_coalesced": ("all_gather_into_tensor_coalesced", 1, 0),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 1, 0),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor_coalesced", 3, 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 3, 0),
    "all_to_all_single": ("all_to_all_single", 3, None),
    "all_to_all_single_autograd": ("all_to_all_single", 3, None),
}


BUCKET_LABEL = "DDP gradient bucket"
BUCKET_HINT = ("DDP's gradient buckets differ across ranks: give every rank's DDP the same bucket_cap_mb, "
               "find_unused_parameters and static_graph")


def bucket_hint(sites: list[str]) -> str | None:
    """What to compare when a mismatch is in DDP's buckets (the sites carry their label)."""
    return BUCKET_HINT if any(f"({BUCKET_LABEL} " in site for site in sites) else None


def funcol_group(group):
    """The ProcessGroup behind funcol's group argument (a group, its name, ranks, a mesh and axis)."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    resolved = funcol._resolve_group(group)
    return c10d._resolve_process_group(resolved) if isinstance(resolved, str) else resolved


def wrap_funcol(patch) -> None:
    """Wrap funcol's collective functions with `patch`'s recorder and checker."""
    import torch.distributed._functional_collectives as funcol

    for name, (op, group_pos, tensor_pos) in FUNCOL_OPS.items():
        original = getattr(funcol, name, None)
        if original is None or hasattr(original, "__meshrun_wrapped__"):
            continue
        where = None if tensor_pos is None else (tensor_pos, "self")
        wrapper = patch.wrap(op, original, where=where, group_pos=group_pos, resolve_group=funcol_group)
        patch.replace(funcol, name, original, wrapper)


def patch_ddp(patch) -> None:
    """Route DDP's bucket all-reduces through `dist.all_reduce` at each model's first forward."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.forward
    if hasattr(original, "__meshrun_wrapped__"):
        return
    compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if "_meshrun_buckets_seen" not in self.__dict__ and not compiling():  # registered eagerly, once
            self.__dict__["_meshrun_buckets_seen"] = True
            if patch.installed:
                _register_bucket_hook(self, patch)
        return original(self, *args, **kwargs)

    forward.__meshrun_wrapped__ = original
    patch.replace(DistributedDataParallel, "forward", original, forward)


def _register_bucket_hook(ddp, patch) -> None:
    if getattr(ddp, "reducer", None) is None or getattr(ddp, "_use_python_reducer", False):
        return  # compiled autograd: DDP all-reduces through funcol, wrapped above
    if ddp._comm_hooks or ddp._get_ddp_logging_data().get("comm_hook"):
        return  # the user's own hook: a Python one calls dist.*, seen; a built-in one is not
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def meshrun_fingerprinted_allreduce(process_group, bucket):
        with patch.labelled(f"{BUCKET_LABEL} {bucket.index()}"):
            return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(ddp.process_group, meshrun_fingerprinted_allreduce)
