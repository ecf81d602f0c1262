"""Launch overhead: time from the launch command to the first line of user code, meshrun vs torchrun.

    python benchmarks/launch_overhead.py --repeats 5 --nproc-per-node 2

Both launchers start the same 2-process script, alternating run by run so machine noise hits
both alike. The script's first line records time.time(); the figure per run is the latest
rank's first line minus the moment the launcher was started. Prints the medians and the ratio
meshrun / torchrun (target <= 1.10). Every run is bounded by --timeout and killed by pid.
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


def _launcher_cmd(name: str, nproc: int, script: str) -> list[str]:
    bindir = os.path.dirname(sys.executable)
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), script]
    meshrun = shutil.which("meshrun", path=bindir) or "meshrun"
    return [meshrun, "launch", "--nproc-per-node", str(nproc), script]


def time_to_first_line(name: str, nproc: int, script: str, timeout: float) -> float:
    with tempfile.TemporaryDirectory() as bench_dir:
        env = dict(os.environ, BENCH_DIR=bench_dir)
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
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first_line.py")
        with open(script, "w") as fp:
            fp.write(FIRST_LINE_SCRIPT)
        times: dict[str, list[float]] = {"torchrun": [], "meshrun": []}
        time_to_first_line("torchrun", args.nproc_per_node, script, args.timeout)  # warm caches
        for i in range(args.repeats):
            order = ("torchrun", "meshrun") if i % 2 == 0 else ("meshrun", "torchrun")
            for name in order:
                times[name].append(time_to_first_line(name, args.nproc_per_node, script, args.timeout))
    for name, values in times.items():
        print(f"{name:>9}: median {statistics.median(values):.3f} s  "
              f"(runs: {', '.join(f'{v:.3f}' for v in values)})")
    ratio = statistics.median(times["meshrun"]) / statistics.median(times["torchrun"])
    print(f"ratio meshrun/torchrun: {ratio:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
