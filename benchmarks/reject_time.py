"""Time for `meshrun train` to reject bad input, next to `python -c pass` in the same run.

    python benchmarks/reject_time.py --repeats 7

Each kind of mistake below is run --repeats times as a real `meshrun train` process in a fresh
temporary directory (which must stay empty), interleaved with `python -c pass` so machine noise
hits both alike. Prints the median wall time of each, its ratio to `python -c pass`, and whether
it meets the target (< 0.5 s: the rejection path imports no torch). The CPU seconds (user + sys
of the child) are shown too: on a loaded machine they stay put while wall time swells. Every run is bounded by
--timeout and killed by pid if it overruns.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 0.5
KINDS = {
    "bad value (train.steps=-1)": ["--set", "train.steps=-1"],
    "unknown key (train.step)": ["--set", "train.step=5"],
    "flag for a key (--steps 20)": ["--steps", "20"],
    "run_dir is a file": ["--set", "train.run_dir=a-file"],
    "--master-port 99999": ["--master-port", "99999"],
    "--hang-timeout nan": ["--hang-timeout", "nan"],
    "model.dim=1e9 (memory)": ["--set", "model.dim=1000000000"],
    "model.factory=os:system": ["--set", "model.factory=os:system"],
    "--nnodes 2, no endpoint": ["--nnodes", "2"],
}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(cmd: list[str], cwd: str, timeout: float, cpu: list[float] | None = None) -> tuple[float, int, str]:
    """(wall seconds, exit code, stderr) of one bounded run; its CPU seconds appended to `cpu`."""
    cpu0 = _cpu()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return float("inf"), -1, "timed out"
    took = time.perf_counter() - start
    if cpu is not None:
        cpu.append(_cpu() - cpu0)
    return took, proc.returncode, err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per kind (median reported); 1-50")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a run is killed")
    args = parser.parse_args()
    repeats = max(1, min(args.repeats, 50))
    meshrun = shutil.which("meshrun", path=os.path.dirname(sys.executable)) or "meshrun"
    baseline: list[float] = []
    base_cpu: list[float] = []
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    cpus: dict[str, list[float]] = {kind: [] for kind in KINDS}
    bad: list[str] = []
    for _ in range(repeats):
        for kind, argv in KINDS.items():
            with tempfile.TemporaryDirectory(prefix="meshrun-reject-") as cwd:
                with open(os.path.join(cwd, "a-file"), "w") as fp:
                    fp.write("not a directory")
                baseline.append(_run([sys.executable, "-c", "pass"], cwd, args.timeout, base_cpu)[0])
                took, code, err = _run([meshrun, "train", *argv], cwd, args.timeout, cpus[kind])
                times[kind].append(took)
                lines = err.strip().splitlines()
                if code != 2 or len(lines) != 1 or sorted(os.listdir(cwd)) != ["a-file"]:
                    bad.append(f"{kind}: exit {code}, {len(lines)} line(s), dir {sorted(os.listdir(cwd))}")
    base = statistics.median(baseline)
    print(f"{'input':<32} {'median s':>9} {'x python -c pass':>17} {'CPU s':>6}  target < {TARGET_S} s")
    print(f"{'python -c pass':<32} {base:>9.3f} {1.0:>17.1f} {statistics.median(base_cpu):>6.3f}")
    worst = 0.0
    for kind, runs in times.items():
        med = statistics.median(runs)
        worst = max(worst, med)
        cpu = statistics.median(cpus[kind])
        print(f"{kind:<32} {med:>9.3f} {med / base:>17.1f} {cpu:>6.3f}  {'ok' if med < TARGET_S else 'SLOW'}")
    print(f"slowest median rejection: {worst:.3f} s ({repeats} run(s) per kind); "
          f"{'meets' if worst < TARGET_S else 'misses'} the {TARGET_S} s target")
    for line in bad:
        print(f"NOT ONE LINE / EXIT 2 / CLEAN: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
