"""Trainer overhead: median step time of `meshrun train` vs the guide's hand-written DDP loop.

    python benchmarks/trainer_overhead.py --repeats 2 --steps 60

Same model (tiny), batch, sequence length, dtype (fp32), no gradient clipping (the guide's loop
has none; --grad-clip 1.0 measures meshrun's default) and number of processes; the two runs
alternate so machine noise hits both alike. meshrun's step time comes from its per-rank log
(ranks/rank0.jsonl), the baseline's from its own timer; both skip the first `--warmup` steps.
Prints the medians and the ratio meshrun / hand-written (target <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def _run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def meshrun_step_time(args, workdir: Path, index: int) -> float:
    name = f"bench{index}"
    _run([str(BIN / "meshrun"), "train", "--nproc-per-node", str(args.nproc),
          "--set", f"train.steps={args.steps}", "--set", f"train.batch_size={args.batch_size}",
          "--set", f"data.seq_len={args.seq_len}", "--set", "train.eval_interval=0",
          "--set", "train.eval_steps=1", "--set", f"train.run_dir={workdir}", "--set", f"train.name={name}",
          "--set", "metrics.tensorboard=false", "--set", f"train.grad_clip={args.grad_clip}"], args.timeout)
    rows = [json.loads(line) for line in (workdir / name / "ranks" / "rank0.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r.get("step", 0) > args.warmup]
    return statistics.median(times)


def baseline_step_time(args) -> float:
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                str(HERE / "ddp_baseline.py"), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                "--seq-len", str(args.seq_len), "--warmup", str(args.warmup)], args.timeout)
    return float(re.search(r"median_step_time_s=([\d.]+)", out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--grad-clip", type=float, default=0.0,
                        help="meshrun's train.grad_clip; 0 = off, like the guide's loop (default)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for which in order:
                if which == 0:
                    ours.append(meshrun_step_time(args, Path(tmp), i))
                else:
                    theirs.append(baseline_step_time(args))
    print(f"meshrun train: median step {statistics.median(ours) * 1000:.1f} ms  (runs: {[round(t * 1000, 1) for t in ours]})")
    print(f" hand-written: median step {statistics.median(theirs) * 1000:.1f} ms  (runs: {[round(t * 1000, 1) for t in theirs]})")
    print(f"ratio meshrun/hand-written: {statistics.median(ours) / statistics.median(theirs):.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
