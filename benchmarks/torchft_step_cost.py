"""What the torchft mode costs per step: the same `meshrun train` in exact and torchft mode.

    python benchmarks/torchft_step_cost.py                  # tiny model, 60 steps, 2 x 1 process
    python benchmarks/torchft_step_cost.py --steps 200 --rounds 3 --set model.dim=256

Exact mode runs 2 DDP processes (`--nproc-per-node 2`); torchft mode runs 2 replica groups of
1 process (`fault.replica_groups=2`, `fault.group_size=1`): the same global batch, the same
data, the same model. Rounds alternate the two so machine noise hits both alike. Per run two
figures from metrics.jsonl's per-step rows after the first 5 steps (rank 0; in torchft mode
group 0): the median time between consecutive rows (the whole step: in torchft mode the quorum
before it too), and the median `step_time_s` (forward, backward, all-reduce, the commit vote and
the optimizer; not the quorum). Prints each mode's median over the rounds and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "configs" / "tiny.toml"
MODES = {"exact": ["--nproc-per-node", "2"],
         "torchft": ["--set", "fault.mode=torchft", "--set", "fault.replica_groups=2", "--set", "fault.group_size=1"]}


def step_time(mode: str, steps: int, extra: list[str], timeout: float) -> tuple[float, float]:
    meshrun = shutil.which("meshrun", path=os.path.dirname(sys.executable)) or "meshrun"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [meshrun, "train", str(TINY), "--set", "train.name=bench", "--set", f"train.run_dir={tmp}",
               "--set", f"train.steps={steps}", "--set", "metrics.interval=1", "--set", "train.eval_interval=0",
               "--set", "checkpoint.interval=0", *MODES[mode], *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "RUST_LOG": "warn"}, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise SystemExit(f"{mode}: no result within {timeout}s") from None
        if proc.returncode:
            raise SystemExit(f"{mode}: exit {proc.returncode}\n{err[-2000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r.get("kind") == "train" and r["step"] > 5]
        walls = [b["time"] - a["time"] for a, b in zip(train, train[1:], strict=False) if b["step"] == a["step"] + 1]
        return statistics.median(walls), statistics.median(r["step_time_s"] for r in train)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for both")
    args = parser.parse_args()
    extra = [token for item in args.overrides for token in ("--set", item)]
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else reversed(list(MODES)):
            results[mode].append(step_time(mode, args.steps, extra, args.timeout))
            wall, inner = results[mode][-1]
            print(f"round {round_ + 1} {mode:8s} whole step {wall * 1e3:7.1f} ms, step_time_s {inner * 1e3:7.1f} ms",
                  flush=True)
    for i, what in enumerate(("whole step (row to row)", "step_time_s")):
        exact, ft = (statistics.median(r[i] for r in results[m]) for m in MODES)
        print(f"{what:24s} exact {exact * 1e3:7.1f} ms, torchft {ft * 1e3:7.1f} ms: "
              f"torchft / exact {ft / exact:.2f} ({(ft - exact) * 1e3:+.1f} ms per step)")


if __name__ == "__main__":
    main()
