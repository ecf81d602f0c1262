"""Async-save staging that copies only what this rank will write.

The part of `dcp.async_save` that blocks the loop is the copy of the state into staging memory.
DCP's DefaultStager copies all of every rank's state, though its planner then leaves each
replicated tensor to one rank (`dedup_save_plans`): under DDP each of N ranks writes 1/N of it,
and copied N/N. `OwnedStager` learns the assignment from DCP itself, once, in the call: the
DefaultSavePlanner's local plans of the live state, gathered on the save's coordinator as DCP's
own save gathers them, `create_global_plan`'s dedup run there, each rank's part sent back. It then copies only
the tensors this rank writes, into buffers kept across saves (pinned when CUDA is there).
`OwnedPlanner` makes the background save write exactly those: its local plan leaves out the
tensors assigned to another rank, so the coordinator's dedup has nothing left to decide and the
files are those DCP would have written.

The assignment is learned again whenever any rank's state changes shape (a one-element
all-reduce per save). Whatever this rank is not sure another rank writes is copied: a tensor not
in the assignment, one under a tuple, a DTensor (through DCP's own stager). Values that are not
tensors are deep-copied on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor


class OwnedStager:
    """An `AsyncStager` for `dcp.async_save` that copies only this rank's share; pair it with
    `planner()` in the same call. Not thread-safe: one save at a time (the Checkpointer's rule)."""

    def __init__(self, group=None, *, pin_memory: bool = False):
        self._group = group
        self._pin = pin_memory
        self._subclass_stager = DefaultStager(StagingOptions(pin_memory, False, False, False))
        self._signature = None
        self._theirs: frozenset = frozenset()  # WriteItem indices another rank writes
        self._theirs_paths: frozenset = frozenset()  # their state-dict paths (DCP's OBJ_PATH)
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:  # the copy is made in stage(): nothing to wait for
        return None

    def planner(self) -> OwnedPlanner:
        """The planner for the save this stager stages (it reads the assignment stage() used)."""
        return OwnedPlanner(self)

    def stage(self, state_dict, **_kwargs):
        leaves: list = []  # (container, key, path, tensor): where each tensor of the copy goes
        staged = _structure(state_dict, (), leaves)
        signature = [(path, tensor.shape, tensor.dtype, _placement(tensor)) for _, _, path, tensor in leaves]
        if self._changed(signature):
            self._learn_assignment(state_dict)
            self._signature = signature
            self._buffers.clear()
        with torch.no_grad():
            for container, key, path, tensor in leaves:
                if path not in self._theirs_paths:  # another rank writes it: the save only reads its shape
                    container[key] = self._copy(path, tensor)
        return staged

    def close(self) -> None:
        self._buffers.clear()
        self._subclass_stager.close()

    # -- the assignment --------------------------------------------------------------------------

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1

    def _changed(self, signature) -> bool:
        changed = signature != self._signature
        if not self._distributed():
            return changed
        flag = torch.tensor([int(changed)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)  # any rank's change: all relearn
        return bool(flag.item())

    def _learn_assignment(self, state_dict) -> None:
        self._theirs, self._theirs_paths = frozenset(), frozenset()
        if not self._distributed():
            return
        planner = DefaultSavePlanner()
        rank = dist.get_rank(self._group)
        planner.set_up_planner(state_dict, is_coordinator=rank == 0)
        local = planner.create_local_plan()
        # DCP's own exchange: the plans to the coordinator, each rank's part of its dedup back
        plans = [None] * dist.get_world_size(self._group) if rank == 0 else None
        dist.gather_object(local, plans, group=self._group, group_dst=0)
        shares = None
        if rank == 0:
            global_plans, _ = planner.create_global_plan(plans)
            shares = [[item.index for item in plan.items] for plan in global_plans]
        box = [None]
        dist.scatter_object_list(box, shares, group=self._group, group_src=0)
        mine = set(box[0])
        theirs = {item.index for item in local.items
                  if item.type != WriteItemType.BYTE_IO and item.index not in mine}
        paths = {planner.mappings.get(index.fqn) for index in theirs}
        # a tensor left to another rank is skipped only whole: none of its chunks is this rank's
        partly_mine = {planner.mappings.get(index.fqn) for index in mine}
        if None in paths:
            return  # a layout this module does not follow: copy everything, write DCP's way
        self._theirs = frozenset(i for i in theirs if planner.mappings[i.fqn] not in partly_mine)
        self._theirs_paths = frozenset(paths - partly_mine)

    # -- the copy --------------------------------------------------------------------------------

    def _copy(self, path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is not torch.Tensor:  # a DTensor or another subclass: DCP's stager knows it
            return self._subclass_stager.stage(tensor)
        buffer = self._buffers.get(path)
        if buffer is None:
            # contiguous, whatever the source's strides (an expanded view included): DCP writes values
            buffer = self._buffers[path] = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu",
                                                       pin_memory=self._pin)
        buffer.copy_(tensor)
        return buffer


class OwnedPlanner(DefaultSavePlanner):
    """DCP's save planner, less the tensors that the paired `OwnedStager` left to another rank."""

    def __init__(self, stager: OwnedStager):
        super().__init__()
        self._stager = stager

    def create_local_plan(self):
        plan = super().create_local_plan()
        theirs = self._stager._theirs
        self.plan = dataclasses.replace(plan, items=[i for i in plan.items if i.index not in theirs])
        return self.plan

    def resolve_data(self, write_item):
        if write_item.index in self._stager._theirs:  # never: the plan left it out
            raise RuntimeError(f"meshrun: {write_item.index.fqn} was not staged on this rank")
        return super().resolve_data(write_item)


def _structure(obj, path: tuple, leaves: list):
    """A copy of the containers DCP walks into (its OBJ_PATHs), values that are not tensors
    deep-copied, and each tensor left in place, listed in `leaves` for stage() to replace."""
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            out[key] = _structure(value, path + (str(key),), leaves)
            if isinstance(value, torch.Tensor):
                leaves.append((out, key, path + (str(key),), value))
        return out
    if isinstance(obj, list) and any(isinstance(v, (torch.Tensor, Mapping, list)) for v in obj):
        out = [_structure(value, path + (i,), leaves) for i, value in enumerate(obj)]
        leaves.extend((out, i, path + (i,), value) for i, value in enumerate(obj) if isinstance(value, torch.Tensor))
        return out
    return obj if isinstance(obj, torch.Tensor) else copy.deepcopy(obj)


def _placement(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.placements), tuple(tensor.to_local().shape)) if isinstance(tensor, DTensor) else ()
