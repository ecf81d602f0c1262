"""Gradient accumulation under FSDP: the step time of `meshrun train`, this tree against an older one.

    python benchmarks/grad_accum.py --before /tmp/old/src          # ~2 minutes
    python benchmarks/grad_accum.py --before /tmp/old/src --grad-accum 2 --nproc 4

Both run tiny under FSDP over `--nproc` CPU processes with `--grad-accum` micro-batches per
optimizer step, alternating so that machine noise hits both alike; the step time is the median
of rank 0's per-step log after `--warmup` steps. meshrun reduce-scatters every micro-batch's
gradients (they stay sharded; an older meshrun skipped the reduce-scatter on all but the last
micro-batch and held every unsharded gradient meanwhile): this prints what the extra
reduce-scatters cost per step, as the ratio this tree / --before. The memory side is in
docs/plan.md (`meshrun plan --simulate` of examples/configs/gpu-8b.toml).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from common import ENV, REPO, run_bounded


def step_time(args, src: str | None, workdir: Path, name: str) -> float:
    env = dict(ENV)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "meshrun", "train", str(REPO / "examples/configs/tiny.toml"),
           "--nproc-per-node", str(args.nproc), "--set", "parallel.strategy=fsdp",
           "--set", f"train.grad_accum={args.grad_accum}", "--set", f"train.steps={args.steps}",
           "--set", "train.eval_interval=0", "--set", "train.eval_steps=1", "--set", "checkpoint.interval=0",
           "--set", "metrics.tensorboard=false", "--set", f"train.run_dir={workdir}", "--set", f"train.name={name}"]
    code, out = run_bounded(cmd, args.timeout, f"meshrun train ({src or 'this tree'})", env=env)
    if code != 0:
        raise SystemExit(f"meshrun train ({src or 'this tree'}) failed ({code}):\n{out[-3000:]}")
    rows = [json.loads(line) for line in (workdir / name / "ranks" / "rank0.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if r.get("step", 0) > args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="SRC", required=True, help="an older meshrun's src directory")
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"this tree": [], args.before: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = [None, args.before] if i % 2 == 0 else [args.before, None]
            for src in order:
                times[src or "this tree"].append(step_time(args, src, Path(tmp), f"run{i}-{'before' if src else 'now'}"))
    now, before = (statistics.median(times[k]) for k in ("this tree", args.before))
    print(f"tiny, fsdp over {args.nproc} CPU processes, grad_accum {args.grad_accum}, median step of rank 0:")
    for label, runs in times.items():
        print(f"  {label}: {statistics.median(runs) * 1000:.1f} ms  (runs: {[round(t * 1000, 1) for t in runs]})")
    print(f"ratio this tree / before: {now / before:.3f}")


if __name__ == "__main__":
    main()
