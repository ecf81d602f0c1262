"""Launch overhead: time from the launch command to the first line of user code, meshrun vs torchrun.

    python benchmarks/launch_overhead.py --repeats 15 --nproc-per-node 2
    python benchmarks/launch_overhead.py --repeats 15 --before /tmp/old/src   # also an older meshrun

Both launchers start the same 2-process script, alternating run by run so machine noise hits
both alike. The script's first line records time.time(); the figure per run is the latest
rank's first line minus the moment the launcher was started. Prints the medians, the ratio
meshrun / torchrun (target <= 1.05), and the median of per-round ratios (steadier when the
machine's load swings). --before SRC adds a third launcher, `meshrun launch` with
PYTHONPATH=SRC (e.g. `git archive HEAD~1 src | tar -x -C /tmp/old`), interleaved with the
other two, to measure a change. Every run is bounded by --timeout and killed by pid.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

FIRST_LINE_SCRIPT = """\
import os, time; _t = time.time()
with open(os.path.join(os.environ["BENCH_DIR"], "rank" + os.environ["RANK"]), "w") as fp:
    fp.write(repr(_t))
"""


TARGET_RATIO = 1.05


def _launcher_cmd(name: str, nproc: int, script: str) -> list[str]:
    bindir = os.path.dirname(sys.executable)
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), script]
    meshrun = shutil.which("meshrun", path=bindir) or "meshrun"
    return [meshrun, "launch", "--nproc-per-node", str(nproc), script]


def time_to_first_line(name: str, nproc: int, script: str, timeout: float, before: str | None = None) -> float:
    with tempfile.TemporaryDirectory() as bench_dir:
        env = dict(os.environ, BENCH_DIR=bench_dir)
        if name == "before":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [before, env.get("PYTHONPATH")]))
        start = time.time()
        proc = subprocess.Popen(_launcher_cmd(name, nproc, script), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise SystemExit(f"{name} did not finish within {timeout}s") from None
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed with exit code {proc.returncode}:\n{err.decode()[-2000:]}")
        stamps = []
        for rank in range(nproc):
            with open(os.path.join(bench_dir, f"rank{rank}")) as fp:
                stamps.append(float(fp.read()))
        return max(stamps) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per launcher (alternating)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--before", metavar="SRC", help="also time `meshrun launch` from this src directory")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first_line.py")
        with open(script, "w") as fp:
            fp.write(FIRST_LINE_SCRIPT)
        names = ["torchrun", "meshrun"] + (["before"] if args.before else [])
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # warm caches
            time_to_first_line(name, args.nproc_per_node, script, args.timeout, args.before)
        for i in range(args.repeats):
            order = names[i % len(names):] + names[:i % len(names)]  # each launcher leads in turn
            for name in order:
                times[name].append(time_to_first_line(name, args.nproc_per_node, script, args.timeout, args.before))
    for name, values in times.items():
        print(f"{name:>9}: median {statistics.median(values):.3f} s  "
              f"(runs: {', '.join(f'{v:.3f}' for v in values)})")
    torchrun = statistics.median(times["torchrun"])
    for name in names[1:]:
        label = "meshrun" if name == "meshrun" else f"meshrun from {args.before}"
        # Per-round ratios pair runs made seconds apart, so that slow swings of a shared machine's
        # load cancel; the ratio of medians is the headline figure.
        paired = statistics.median(m / t for m, t in zip(times[name], times["torchrun"], strict=True))
        print(f"ratio {label}/torchrun: {statistics.median(times[name]) / torchrun:.3f} "
              f"(median of per-round ratios {paired:.3f}; target <= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
