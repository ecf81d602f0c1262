"""OwnedStager on 2 real gloo ranks: each rank copies only the share DCP's dedup gives it, and what
`dcp.async_save` writes is the state at the call, though the live tensors change right after."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

from meshrun.checkpoint.staging import OwnedStager
from meshrun.testing import run_distributed


def _state(rank: int, extra: bool, late: bool = False) -> dict:
    torch.manual_seed(0)  # replicated: the same values on every rank, as under DDP
    model = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    optim = {"state": {f"layer{i}.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 64)}
                       for i in range(6)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [f"layer{i}.weight" for i in range(6)]}]}
    model["head.transposed"] = torch.randn(4, 3).t()  # a view that is not contiguous
    state = {"model": model, "optim": optim}
    if extra:  # a tensor only this rank holds: the assignment is learned again
        state["model"][f"only_on_rank{rank}"] = torch.full((8,), float(rank))
    if late and rank == 1:  # a change on one rank only: the other must learn again with it, not hang
        state["model"]["late_on_rank1"] = torch.full((16,), 7.0)
    return state


def _dtensors() -> dict:
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(1)
    return {"sharded": distribute_tensor(torch.randn(32, 16), mesh, [Shard(0)]),
            "replicated": distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])}


def _save_then_mutate(stager: OwnedStager, state: dict, path: str) -> tuple[dict, int]:
    """Async-save `state`, change every tensor in place at once (the next optimizer step), wait."""
    expected = {k: v.clone() for k, v in _flat(state).items()}
    future = dcp.async_save(state, checkpoint_id=path, process_group=stager._group, async_stager=stager,
                            planner=stager.planner())
    staged_bytes = sum(b.numel() * b.element_size() for b in stager._buffers.values())
    with torch.no_grad():
        for tensor in _flat(state).values():
            tensor.add_(1000.0)
    getattr(future, "upload_completion", future).result()
    dist.barrier()
    return expected, staged_bytes


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value.to_local() if hasattr(value, "to_local") else value
    return out


def _load(template: dict, path: str) -> dict:
    fresh = {k: v for k, v in template.items()}
    dcp.load(fresh, checkpoint_id=path)
    return fresh


def staged_and_written(workdir: str) -> dict:
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    stager = OwnedStager(group)
    out = {}
    # the second changes shape on both ranks, the third on rank 1 only
    for name, extra, late in (("plain", False, False), ("extra", True, False), ("late", True, True)):
        state = _state(rank, extra, late)
        path = os.path.join(workdir, name)
        expected, staged = _save_then_mutate(stager, state, path)
        loaded = _load(_state(rank, extra, late), path)
        out[name] = {"equal": all(torch.equal(_flat(loaded)[k], v) for k, v in expected.items()),
                     "staged": staged, "total": sum(v.numel() * v.element_size() for v in expected.values()),
                     "lr": loaded["optim"]["param_groups"][0]["lr"]}
    state = _dtensors()
    path = os.path.join(workdir, "dtensor")
    expected, _ = _save_then_mutate(stager, state, path)
    loaded = _load(_dtensors(), path)
    out["dtensor"] = {"equal": all(torch.equal(_flat(loaded)[k], v) for k, v in expected.items()),
                      "theirs": sorted(i.fqn for i in stager._theirs)}
    stager.close()
    return out


def test_each_rank_stages_its_share_and_the_checkpoint_is_the_state_at_the_call(tmp_path):
    results = run_distributed(staged_and_written, world_size=2, args=(str(tmp_path),), timeout=120)
    for rank, out in enumerate(results):
        for name in ("plain", "extra", "late", "dtensor"):
            assert out[name]["equal"], (rank, name)  # the values at the call, not after the change
        assert out["plain"]["lr"] == 1e-3
        # about half of the replicated state each (DCP's dedup balances bytes), never all of it
        assert 0.3 < out["plain"]["staged"] / out["plain"]["total"] < 0.7, out["plain"]
    # together the two shares are the whole replicated state, once
    assert results[0]["plain"]["staged"] + results[1]["plain"]["staged"] == results[0]["plain"]["total"]
    # the replicated DTensor is written by one rank; the sharded one by both
    assert sorted(results[0]["dtensor"]["theirs"] + results[1]["dtensor"]["theirs"]) == ["replicated"]
