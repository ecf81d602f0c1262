"""Per-rank host memory of `meshrun train` under FSDP and PP, against one process.

    python benchmarks/memory.py                         # model base (126M), 1 process, fsdp2, fsdp4, pp2
    python benchmarks/memory.py --layouts single,fsdp2 --steps 3 --model small

Each layout runs `meshrun train` (a few steps, batch 1, no checkpoints, bounded by --timeout; a
run that overstays is killed by its process group id). Every rank records its resident memory
when the runtime is up and before the model exists (the torch runtime), then its peak at the
end of start-up (model materialised, optimizer built, before the first forward), after the
first step, after the last step, and after the final weights are saved (rank 0 gathers the
whole model there); the trainer writes them to metrics.jsonl (`rss_*` in the "end" record).
Printed per rank: each peak above the runtime, in MiB, and its ratio to the one-process run.
Targets: start-up <= 1/N + 0.10, and the training peak of FSDP 2 <= 0.60. The last
columns are `meshrun plan`'s estimate for the layout (state + activations, and with FSDP's
gather buffers) to compare with what the rank really held.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
MIB = 1 << 20

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "fsdp2": (2, ["--set", "parallel.strategy=fsdp"]),
    "fsdp4": (4, ["--set", "parallel.strategy=fsdp"]),
    "pp2": (2, ["--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=1"]),
}
MARKS = ("rss_peak_startup_bytes", "rss_peak_first_step_bytes", "rss_peak_trained_bytes", "rss_peak_bytes")
HEAD = ("start-up", "1st step", "trained", "with save")


def run_layout(name: str, args, workdir: Path) -> dict:
    nproc, extra = LAYOUTS[name]
    cmd = [str(BIN / "meshrun"), "train", "--nproc-per-node", str(nproc),
           "--set", f"model.name={args.model}", "--set", f"train.steps={args.steps}",
           "--set", "train.batch_size=1", "--set", f"data.seq_len={args.seq_len}",
           "--set", "train.eval_interval=0", "--set", "train.eval_steps=1", "--set", "checkpoint.interval=0",
           "--set", "metrics.tensorboard=false", "--set", "metrics.interval=1",
           "--set", f"train.run_dir={workdir}", "--set", f"train.name={name}", *extra]
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: our own process group
        proc.communicate()
        raise SystemExit(f"{name}: no result within {args.timeout}s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{out[-3000:]}")
    records = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    end = next(r for r in records if r.get("kind") == "meta" and r.get("event") == "end")
    runtime = end["rss_runtime_bytes"]
    return {"nproc": nproc, "runtime": runtime,
            "above": {mark: [p - r for p, r in zip(end[mark], runtime, strict=True)] for mark in MARKS}}


def plan_bytes(name: str, args) -> tuple[int, int]:
    """`meshrun plan`'s per-rank estimate for the layout: (state + activations, + FSDP buffers)."""
    from meshrun.models.factory import model_args_from_config
    from meshrun.parallel.dims import ParallelDims
    from meshrun.plan import estimate

    nproc, _ = LAYOUTS[name]
    model = model_args_from_config(argparse.Namespace(name=args.model), 259)
    fsdp, pp = name.startswith("fsdp"), name.startswith("pp")
    dims = ParallelDims(dp_replicate=1 if fsdp or pp else nproc, dp_shard=nproc if fsdp else 1, tp=1,
                        pp=nproc if pp else 1, world_size=nproc)
    est = estimate(model, dims, batch_size=1, seq_len=args.seq_len)
    return est.state + est.activations, est.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="single,fsdp2,fsdp4,pp2",
                        help=f"comma-separated, from {', '.join(LAYOUTS)}; 'single' is the baseline")
    parser.add_argument("--model", default="base", help="model.name (default base, 126M parameters)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--seq-len", type=int, default=128, help="data.seq_len (batch is 1 per rank)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    parser.add_argument("--save", type=Path, help="also write the raw figures to this JSON file")
    parser.add_argument("--load", type=Path, help="print figures saved by --save instead of running")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra worker environment, e.g. MALLOC_MMAP_THRESHOLD_=33554432 (repeatable)")
    args = parser.parse_args()
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    if "single" not in names:
        names.insert(0, "single")
    if args.load:
        results = json.loads(args.load.read_text())
    else:
        results = {}
        with tempfile.TemporaryDirectory(prefix="meshrun-memory-") as tmp:
            for name in names:
                results[name] = run_layout(name, args, Path(tmp))
                if args.save:  # after each run: a later failure keeps the earlier figures
                    args.save.write_text(json.dumps(results))
    report(results, args)


def report(results: dict, args) -> None:
    base = {mark: results["single"]["above"][mark][0] for mark in MARKS}
    print(f"model {args.model}, seq {args.seq_len}, batch 1, {args.steps} steps; MiB above the torch runtime "
          f"(runtime RSS in brackets); ratio = rank / one process")
    print(f"{'layout':<8} {'rank':>4} {'runtime':>9} " + " ".join(f"{h:>17}" for h in HEAD)
          + f" {'plan':>8} {'plan+buf':>8}")
    for name, res in results.items():
        planned, with_buffers = plan_bytes(name, args)
        for rank in range(res["nproc"]):
            cells = []
            for mark in MARKS:
                value = res["above"][mark][rank]
                cells.append(f"{value / MIB:8.0f} ({value / base[mark]:5.2f}x)")
            print(f"{name:<8} {rank:>4} [{res['runtime'][rank] / MIB:6.0f}] " + " ".join(cells)
                  + f" {planned / MIB:8.0f} {with_buffers / MIB:8.0f}")
        n = res["nproc"]
        if n > 1 and name.startswith("fsdp"):
            worst = max(res["above"][MARKS[0]]) / base[MARKS[0]]
            print(f"{'':<8} start-up worst {worst:.2f}x (target <= {1 / n + 0.10:.2f})"
                  + (f"; trained worst {max(res['above'][MARKS[2]]) / base[MARKS[2]]:.2f}x (target <= 0.60)"
                     if n == 2 else ""))


if __name__ == "__main__":
    main()
