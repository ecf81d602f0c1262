"""Mismatched collectives under `--debug collectives`: seconds from the fault to meshrun's report.

    python benchmarks/mismatches.py --repeats 1 --timeout 120

Three 2-process `meshrun launch --debug collectives` scripts, each with one fault on rank 1:
1. user:    rank 1 all_reduces a tensor of another shape (a line rank 0 never calls from);
2. ddp:     rank 1 builds its DDP model with bucket_cap_mb=0.01 (rank 0 keeps the default), with
            find_unused_parameters=True, so its reducer's first gradient bucket holds fewer
            parameters. DDP's constructor only compares parameter shapes across ranks (an extra
            or resized parameter is refused there, before any bucket exists), so a different
            bucket layout gets past it and the reducer's all-reduce of bucket 0 is the first
            collective that differs. (Without find_unused_parameters torch 2.13 puts every
            parameter in one bucket for the first iteration and then copies rank 0's rebuilt
            layout to all ranks, so a different bucket_cap_mb alone is harmless.) Without
            --debug collectives, gloo aborts rank 1 with "Received data size doesn't match
            expected size", naming neither the op nor a line;
3. dtensor: rank 1 redistributes a Partial DTensor to Shard(0) (a reduce_scatter) where rank 0
            goes to Replicate (an all_reduce), from a line rank 0 never uses.
Each script writes the time of its fault to a file just before it; the figure is the time from
there to the launcher's exit. The table says whether the report names the rank, the op and a
file:line of the script. Every run is bounded by --timeout; a run that overruns is killed by its
process group id.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from common import BIN, run_bounded

TARGET_S = 10.0

USER = """\
import sys, time
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
x = torch.ones(4)
for step in range(3):
    if env.rank == 1 and step == 1:
        open(sys.argv[1], "w").write(repr(time.time()))
        dist.all_reduce(torch.ones(8))  # FAULT
        continue
    dist.all_reduce(x)
meshrun.shutdown()
"""

DDP = """\
import sys, time
import torch
from torch import nn
import meshrun

env = meshrun.init()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
cap = 0.01 if env.rank == 1 else None  # FAULT: rank 1's buckets hold fewer parameters
model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap, find_unused_parameters=True)
x, y = torch.randn(8, 64), torch.randn(8, 1)
for step in range(3):
    loss = nn.functional.mse_loss(model(x), y)
    if step == 0:
        open(sys.argv[1], "w").write(repr(time.time()))
    loss.backward()
meshrun.shutdown()
"""

DTENSOR = """\
import sys, time
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
import meshrun

env = meshrun.init()
mesh = init_device_mesh("cpu", (2,))
partial = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
for step in range(3):
    if env.rank == 1 and step == 1:
        open(sys.argv[1], "w").write(repr(time.time()))
        partial.redistribute(mesh, [Shard(0)]).to_local()  # FAULT
        continue
    partial.redistribute(mesh, [Replicate()]).to_local()
meshrun.shutdown()
"""

SCENARIOS = {"user": (USER, "all_reduce"), "ddp": (DDP, "all_reduce"), "dtensor": (DTENSOR, "reduce_scatter_tensor")}


def fault_line(script: str, name: str) -> int:
    """The 1-based line of the script the report should name (DDP: the backward() call)."""
    lines = script.splitlines()
    needle = "loss.backward()" if name == "ddp" else "# FAULT"
    return next(i for i, line in enumerate(lines, 1) if needle in line)


def run_scenario(tmp: Path, name: str, timeout: float) -> tuple[float, str]:
    """(seconds from the fault to the launcher's exit, the launcher's output)."""
    script, mark = tmp / f"{name}.py", tmp / f"mark-{name}"
    script.write_text(SCENARIOS[name][0])
    mark.unlink(missing_ok=True)
    cmd = [str(BIN / "meshrun"), "launch", "--nproc-per-node", "2", "--debug", "collectives", str(script), str(mark)]
    returncode, out = run_bounded(cmd, timeout, f"{name}: the launch with the fault")
    ended = time.time()
    if returncode == 0 or not mark.exists():
        raise SystemExit(f"{name}: the fault was not reported (exit {returncode}):\n{out[-3000:]}")
    return ended - float(mark.read_text()), out


def names(out: str, name: str) -> tuple[bool, bool, bool]:
    """Does the mismatch report name rank 1, the op rank 1 called, and the script's file:line?"""
    report = next((line for line in out.splitlines() if "collective mismatch" in line), "")
    rank = bool(re.search(r"rank (\d+, )*1\b", report))
    op = f"{SCENARIOS[name][1]}(" in report
    site = f"{name}.py:{fault_line(SCENARIOS[name][0], name)}" in report
    return rank, op, site


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each scenario (the median is shown)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per run; a run past it is killed")
    parser.add_argument("--only", default="", help="comma list of scenarios to run: user,ddp,dtensor (default all)")
    parser.add_argument("--show", action="store_true", help="print each run's mismatch report line")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    chosen = [n for n in SCENARIOS if not args.only or n in args.only.split(",")]
    print(f"{'fault':<9} {'fault->report s':>15}  {'rank':<5} {'op':<5} {'file:line':<9} target <= {TARGET_S:g} s")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for scenario in chosen:
            runs = [run_scenario(tmp, scenario, args.timeout) for _ in range(args.repeats)]
            seconds = statistics.median(s for s, _ in runs)
            rank, op, site = names(runs[-1][1], scenario)
            print(f"{scenario:<9} {seconds:>15.1f}  {'yes' if rank else 'NO':<5} {'yes' if op else 'NO':<5} "
                  f"{'yes' if site else 'NO':<9} {'ok' if seconds <= TARGET_S else 'OVER'} "
                  f"(runs {[round(s, 1) for s, _ in runs]})", flush=True)
            if args.show:
                print("   ", next((ln for ln in runs[-1][1].splitlines() if "collective mismatch" in ln), "-"))


if __name__ == "__main__":
    main()
