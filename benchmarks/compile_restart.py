"""train.compile after a restart: the restarted worker's compile time against the cold compile.

    python benchmarks/compile_restart.py                          # examples/configs/tiny.toml, 2 processes
    python benchmarks/compile_restart.py --set model.dim=128 --set model.n_layers=4 --nproc 1

A report, not a gate. One `meshrun train ... --set train.compile=true --max-restarts 1` run in a
fresh temporary directory, with MESHRUN_FAULT=ckpt_write:KILL (meshrun.checkpoint.manager): the
last rank SIGKILLs itself in the middle of writing checkpoint KILL on the first attempt, the agent
restarts the workers, and they resume from the checkpoint before it, as after any crash. Attempt
0 compiles cold (an empty `<run>/compile-cache`); attempt 1 compiles from that cache. Then, with
--resume-too, the finished run is trained further by a second command (`--force`, more steps),
as a run resumed by hand. Printed from the run's metrics.jsonl ("compile" rows, one per start of
the workers): torch's compile seconds (`compile_s`: dynamo, AOTAutograd and inductor, cache
lookups included), the first step's seconds, the caches' hits and misses, each restart's ratio to
the cold compile, and the seconds from the workers' start to the last rank's first step
(events.jsonl: torch's import, rendezvous, build, resume and first step: the whole recovery). The load average is printed before and after. Each command is
bounded by --timeout and killed by process group if it overruns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESHRUN = Path(sys.executable).with_name("meshrun")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _train(run_root: Path, args, extra: list[str], env: dict[str, str]) -> float:
    cmd = [str(MESHRUN), "train", str(args.config), "--nproc-per-node", str(args.nproc), "--max-restarts", "1",
           "--set", f"train.run_dir={run_root}", "--set", "train.name=restart", "--set", "train.compile=true",
           "--set", "checkpoint.interval=2", "--set", "train.eval_interval=0", *extra]
    for item in args.set:
        cmd += ["--set", item]
    started = time.monotonic()
    base = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # the run's own cache
    proc = subprocess.Popen(cmd, cwd=run_root, env={**base, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        raise SystemExit(f"meshrun train did not finish within {args.timeout:.0f} s:\n{out[-3000:]}") from None
    if proc.returncode != 0:
        raise SystemExit(f"meshrun train exited {proc.returncode}:\n{out[-3000:]}")
    return time.monotonic() - started


def _start_to_first_step(run_dir: Path) -> list[float]:
    """Per start of the workers: seconds from the first worker's start to the last rank's first step
    (events.jsonl: torch's import, the rendezvous, building, resuming and the first step, compile included)."""
    from meshrun.runtime.events import read

    out = []
    for group in _starts_in_order(read(run_dir)):
        began = min(r["time"] for r in group if r["event"] == "worker_start")
        done = [r["time"] for r in group if r["event"] == "first_step"]
        if done:
            out.append(max(done) - began)
    return out


def _starts_in_order(rows: list[dict]) -> list[list[dict]]:
    """events.jsonl cut at each new start of the workers (a worker_start after a first_step)."""
    groups: list[list[dict]] = []
    for row in rows:
        if row["event"] == "worker_start" and (not groups or any(r["event"] == "first_step" for r in groups[-1])):
            groups.append([])
        if groups:
            groups[-1].append(row)
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "examples" / "configs" / "tiny.toml"))
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="passed to meshrun train")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill", type=int, default=6, help="the checkpoint step whose write the fault kills (even, < --steps)")
    p.add_argument("--resume-too", action="store_true", help="then train the finished run further by hand")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    args = p.parse_args()
    print(f"load average {_load()} on {os.cpu_count()} cores; {args.config}, {args.nproc} process(es), "
          f"{' '.join(args.set) or 'no --set'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="compile-restart-") as tmp:
        root = Path(tmp)
        wall = _train(root, args, ["--set", f"train.steps={args.steps}"], {"MESHRUN_FAULT": f"ckpt_write:{args.kill}"})
        print(f"run with one SIGKILL and one restart: {wall:.1f} s wall", flush=True)
        if args.resume_too:
            wall = _train(root, args, ["--set", f"train.steps={args.steps + 2}", "--force"], {})
            print(f"resumed by hand for 2 more steps: {wall:.1f} s wall", flush=True)
        rows = [json.loads(line) for line in (root / "restart" / "metrics.jsonl").read_text().splitlines()]
        compiles = [r for r in rows if r.get("event") == "compile"]
        assert compiles, "no compile rows in metrics.jsonl"
        cold = compiles[0]["compile_s"]
        starts = _start_to_first_step(root / "restart")
        for i, row in enumerate(compiles):
            what = "cold" if i == 0 else ("after the SIGKILL restart" if i == 1 else "resumed by hand")
            start = f"{starts[i]:6.2f}" if i < len(starts) else "     ?"
            print(f"{what:26s} compile_s {row['compile_s']:6.2f}  first step {row['first_step_s']:6.2f} s  "
                  f"worker start to first step done {start} s  "
                  f"{row['compile_s'] / cold:5.2f}x cold  fx graph cache hit/miss {row['fx_graph_cache_hit']}/"
                  f"{row['fx_graph_cache_miss']}  autograd cache hit/miss {row['autograd_cache_hit']}/"
                  f"{row['autograd_cache_miss']}", flush=True)
    print(f"load average {_load()}", flush=True)


if __name__ == "__main__":
    main()
