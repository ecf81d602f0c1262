"""`--debug collectives` sees the collectives torch issues for the user: DDP's reducer buckets
and DTensor's redistributions. A divergence in either is named with the rank, the op and the
script's file:line; a run without one trains as before. How fast the report comes is measured by
benchmarks/mismatches.py; here a run is only bounded."""

from __future__ import annotations

import pytest
from conftest import meshrun

SCRIPT = """\
import sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
import meshrun

env = meshrun.init()
mode = sys.argv[1]
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
cap = 0.01 if (mode == "ddp" and env.rank == 1) else None
model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap, find_unused_parameters=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 64) + env.rank, torch.randn(8, 1)
for step in range(2):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # BACKWARD
    opt.step()
mesh = init_device_mesh("cpu", (2,))
partial = DTensor.from_local(torch.full((4, 4), float(env.rank + 1)), mesh, [Partial()])
for step in range(2):
    if mode == "dtensor" and env.rank == 1 and step == 1:
        partial.redistribute(mesh, [Shard(0)]).to_local()  # FAULT
        continue
    full = partial.redistribute(mesh, [Replicate()]).to_local()
assert torch.equal(full, torch.full((4, 4), 3.0)), full
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
both = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(both, flat)
assert torch.equal(both[0], both[1]), "replicas drifted: the bucket all-reduce did not average"
print("finished", flush=True)
meshrun.shutdown()
"""
BACKWARD = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if "# BACKWARD" in line)
FAULT = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if "# FAULT" in line)
OMP = {"OMP_NUM_THREADS": "1"}


def _launch(tmp_path, mode: str):
    script = tmp_path / "indirect.py"
    script.write_text(SCRIPT)
    return meshrun("launch", "--nproc-per-node", "2", "--debug", "collectives", str(script), mode,
                   timeout=90, env=OMP)


def _report(out: str) -> str:
    return next((line for line in out.splitlines() if "CollectiveMismatchError: collective mismatch" in line), "")


@pytest.mark.timeout(120)
def test_ddp_bucket_layouts_that_differ_are_named_at_the_backward_line(tmp_path):
    result = _launch(tmp_path, "ddp")
    out = result.output
    assert result.returncode != 0, out
    report = _report(out)
    # two ranks, one line: no majority, so both are named, each with its bucket and size
    assert "collective mismatch at #1 on group world: rank 0, 1 diverged" in report, out
    assert "rank 0: all_reduce(float32[8385])" in report and "rank 1: all_reduce(float32[129])" in report, report
    assert f"indirect.py:{BACKWARD} in <module> (DDP gradient bucket 0)" in report, report
    assert "DDP's gradient buckets differ across ranks: give every rank's DDP the same bucket_cap_mb" in report


@pytest.mark.timeout(120)
def test_dtensor_redistributions_that_differ_name_the_rank_op_and_line(tmp_path):
    result = _launch(tmp_path, "dtensor")
    out = result.output
    assert result.returncode != 0, out
    assert "Rank 1 failed first" in out or "rank 1 diverged" in out, out
    report = _report(out)
    assert "rank 1 diverged" in report, out
    assert "all_reduce(float32[4, 4])" in report, report  # rank 0: Partial -> Replicate
    assert "reduce_scatter_tensor(float32[4, 4]) at " in report, report  # rank 1: Partial -> Shard(0)
    assert f"indirect.py:{FAULT} in <module>" in report, report


@pytest.mark.timeout(120)
def test_ddp_and_dtensor_agree_and_train_under_the_check(tmp_path):
    result = _launch(tmp_path, "clean")
    assert result.returncode == 0, result.output
    assert result.output.count("finished") == 2, result.output
