"""Diagnostics: seconds from a fault to meshrun's report, and what the checks cost per step.

    python benchmarks/diagnostics.py --repeats 3 --steps 60

1. A rank stalls in user code (--hang-timeout H): seconds from the stall to the job's end,
   against torch's default collective timeout it replaces (30 min on gloo, 10 min on NCCL).
2. A rank makes one extra all_reduce (--debug collectives): seconds from the extra call to
   the job's end, against the same default timeouts.
3. The step-time overhead of --debug collectives on a small DDP loop with one all_reduce per
   step (median per-step time, on vs off, alternating runs).
4. The hang watchdog's overhead on `meshrun train` step time: --hang-timeout 300 (the
   default) vs 0 (off), the same command, alternating runs (target: ratio <= 1.01), and the
   work it adds to each step measured directly (its two optimizer-step hooks), which stays
   meaningful when the machine is too loaded for the ratio to resolve 1%.
Every run is bounded by --timeout; a run that overruns is killed by its process group id.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import run_bounded

BIN = Path(sys.executable).parent
GLOO_DEFAULT_TIMEOUT_S = 1800
NCCL_DEFAULT_TIMEOUT_S = 600

FAULTS = """\
import sys, time
import torch, torch.distributed as dist
import meshrun

def stall_for_ever():
    while True:
        time.sleep(0.5)

env = meshrun.init()
x = torch.ones(4)
for step in range(4):
    dist.all_reduce(x)
    if env.rank == 1 and step == 1:
        open(sys.argv[2], "w").write(repr(time.time()))
        if sys.argv[1] == "stall":
            stall_for_ever()
        dist.all_reduce(x)
"""

LOOP = """\
import sys, time, statistics
import torch, torch.distributed as dist
from torch import nn
import meshrun

env = meshrun.init()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randn(32, 1)
times = []
for step in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    dist.all_reduce(loss.detach())
    times.append(time.perf_counter() - t0)
if env.rank == 0:
    print(f"median_step_s={statistics.median(times[10:]):.6f}", flush=True)
"""


def _run(cmd: list[str], timeout: float, check: bool = True) -> tuple[int, str]:
    returncode, out = run_bounded(cmd, timeout, str(cmd[:3]))
    if check and returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed ({returncode}):\n{out[-3000:]}")
    return returncode, out


def fault_to_report(tmp: Path, mode: str, flags: list[str], timeout: float) -> float:
    script, mark = tmp / "faults.py", tmp / f"mark-{mode}"
    script.write_text(FAULTS)
    mark.unlink(missing_ok=True)
    code, out = _run([str(BIN / "meshrun"), "launch", "--nproc-per-node", "2", *flags, str(script), mode, str(mark)],
                     timeout, check=False)
    ended = time.time()
    if code == 0 or not mark.exists():
        raise SystemExit(f"the {mode} fault was not reported:\n{out[-3000:]}")
    return ended - float(mark.read_text())


def loop_step(tmp: Path, steps: int, flags: list[str], timeout: float) -> float:
    script = tmp / "loop.py"
    script.write_text(LOOP)
    _, out = _run([str(BIN / "meshrun"), "launch", "--nproc-per-node", "2", *flags, str(script), str(steps)], timeout)
    return float(re.search(r"median_step_s=([\d.]+)", out).group(1))


def train_step(tmp: Path, args, hang: str, index: int) -> float:
    name = f"wd{hang}-{index}"
    _run([str(BIN / "meshrun"), "train", "--nproc-per-node", "2", "--hang-timeout", hang,
          "--set", f"train.steps={args.steps}", "--set", "model.dim=64", "--set", "model.n_layers=2",
          "--set", "train.eval_interval=0", "--set", "train.eval_steps=1", "--set", f"train.run_dir={tmp}",
          "--set", f"train.name={name}", "--set", "metrics.tensorboard=false"], args.timeout)
    rows = [json.loads(line) for line in (tmp / name / "ranks" / "rank0.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if r.get("step", 0) > args.warmup)


def hook_cost_us(calls: int = 200_000) -> float:
    """Microseconds the watchdog adds to one optimizer step: its step pre- and post-hook, in process."""
    import torch

    from meshrun.debug.optim_check import first_step_check
    from meshrun.runtime import process

    process.get()  # as in a watched worker: the heartbeat has a runtime to count on

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt._meshrun_step_checked = True  # the state after the first step
    start = time.perf_counter()
    for _ in range(calls):
        first_step_check(opt, (), {})
        process.heartbeat()
    return (time.perf_counter() - start) / calls * 1e6


def _alternate(repeats: int, a, b) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i in range(repeats):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            (xs if which == 0 else ys).append(a(i) if which == 0 else b(i))
    return xs, ys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    parser.add_argument("--steps", type=int, default=60, help="steps per overhead run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hang-timeout", type=float, default=10, help="seconds, for the hang measurement")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: hang,mismatch,debug,watchdog")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    skip = set(filter(None, args.skip.split(",")))
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if "hang" not in skip:
            s = fault_to_report(tmp, "stall", ["--hang-timeout", f"{args.hang_timeout:g}"], args.timeout)
            print(f"hang:     {s:.1f} s from the stall to the report (--hang-timeout {args.hang_timeout:g}); "
                  f"torch's default: {GLOO_DEFAULT_TIMEOUT_S} s on gloo, {NCCL_DEFAULT_TIMEOUT_S} s on NCCL "
                  f"({GLOO_DEFAULT_TIMEOUT_S / s:.0f}x / {NCCL_DEFAULT_TIMEOUT_S / s:.0f}x sooner)")
        if "mismatch" not in skip:
            s = fault_to_report(tmp, "extra", ["--debug", "collectives"], args.timeout)
            print(f"mismatch: {s:.1f} s from the extra all_reduce to the report (--debug collectives); "
                  f"torch's default: {GLOO_DEFAULT_TIMEOUT_S} s on gloo, {NCCL_DEFAULT_TIMEOUT_S} s on NCCL")
        if "debug" not in skip:
            on, off = _alternate(args.repeats, lambda i: loop_step(tmp, args.steps, ["--debug", "collectives"],
                                                                   args.timeout),
                                 lambda i: loop_step(tmp, args.steps, [], args.timeout))
            print(f"--debug collectives: median step {statistics.median(on) * 1e3:.2f} ms vs "
                  f"{statistics.median(off) * 1e3:.2f} ms off; ratio {statistics.median(on) / statistics.median(off):.2f} "
                  f"(runs on {[round(t * 1e3, 2) for t in on]}, off {[round(t * 1e3, 2) for t in off]})")
        if "watchdog" not in skip:
            on, off = _alternate(args.repeats, lambda i: train_step(tmp, args, "300", i),
                                 lambda i: train_step(tmp, args, "0", i))
            ratio = statistics.median(on) / statistics.median(off)
            cost = hook_cost_us()
            print(f"watchdog per-step work (step hooks, in process): {cost:.2f} us = "
                  f"{cost / (statistics.median(off) * 1e6) * 100:.4f}% of the median step; its thread polls "
                  f"the store once a second")
            print(f"watchdog on meshrun train: median step {statistics.median(on) * 1e3:.2f} ms (on) vs "
                  f"{statistics.median(off) * 1e3:.2f} ms (off); ratio {ratio:.3f} (target <= 1.01; "
                  f"runs on {[round(t * 1e3, 2) for t in on]}, off {[round(t * 1e3, 2) for t in off]})")


if __name__ == "__main__":
    main()
