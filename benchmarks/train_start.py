"""What one short `meshrun train` costs, start to exit, and how long Ctrl-C takes to stop one.

    python benchmarks/train_start.py --repeats 5
    python benchmarks/train_start.py --repeats 5 --before /tmp/old/src   # against an older meshrun

Each run is `meshrun train examples/configs/tiny.toml --set train.steps=1` on 2 processes: the
launcher's checks, the workers' start, one step, the checkpoint, the report and the exit. The
figures are its wall time and its CPU time (the launcher and every process under it, from the
kernel's accounting of reaped children), the median over --repeats. The test suite is mostly
such runs, so this is also what a test of `meshrun train` costs.

--stop also times SIGINT to the whole process group (a terminal's Ctrl-C) in the middle of a
long run until `meshrun train` exits, as a median over --repeats.

--before SRC runs the same commands with PYTHONPATH=SRC (e.g. `git archive HEAD~1 src | tar -x -C
/tmp/old`), interleaved run by run with the current tree so that machine noise hits both alike,
and prints the ratios after/before. Every run is bounded by --timeout and stopped by pid.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ENV, REPO

from meshrun.testing.processes import kill_tree

TINY = str(REPO / "examples" / "configs" / "tiny.toml")
# `python -m meshrun`, not the venv's console script: an older src/ (--before) may lack its entry point
MESHRUN = [sys.executable, "-m", "meshrun"]


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _env(src: str | None) -> dict[str, str]:
    return {**ENV, "PYTHONPATH": src} if src else dict(ENV)


def one_run(work: Path, name: str, src: str | None, timeout: float) -> tuple[float, float]:
    """(wall s, CPU s) of one short `meshrun train`."""
    cmd = [*MESHRUN, "train", TINY, "--set", f"train.name={name}", "--set", f"train.run_dir={work}",
           "--set", "train.steps=1", "--set", "train.eval_interval=0"]
    cpu, wall = _children_cpu(), time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=_env(src), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise SystemExit(f"train_start: a run took over {timeout} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"train_start: a run failed (exit {proc.returncode}):\n{err[-2000:]}")
    return time.monotonic() - wall, _children_cpu() - cpu


def one_stop(work: Path, name: str, src: str | None, timeout: float) -> float:
    """Seconds from SIGINT to the process group of a running `meshrun train` to its exit."""
    cmd = [*MESHRUN, "train", TINY, "--set", f"train.name={name}", "--set", f"train.run_dir={work}",
           "--set", "train.steps=1000000", "--set", "train.eval_interval=0"]
    proc = subprocess.Popen(cmd, cwd=work, env=_env(src), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = work / name / "metrics.jsonl"
    try:
        deadline = time.monotonic() + timeout
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("train_start: the run to stop ended or never stepped")
            time.sleep(0.05)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=timeout)
        return time.monotonic() - sent
    except subprocess.TimeoutExpired:
        raise SystemExit(f"train_start: the stopped run did not exit within {timeout} s") from None
    finally:
        kill_tree(proc.pid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", metavar="SRC", help="also run an older meshrun's src/ (PYTHONPATH), interleaved")
    parser.add_argument("--stop", action="store_true", help="also time Ctrl-C to exit")
    parser.add_argument("--timeout", type=float, default=180.0, help="bound on each run, seconds")
    args = parser.parse_args()
    trees = {"after": None, **({"before": args.before} if args.before else {})}
    runs: dict[str, list[tuple[float, float]]] = {tree: [] for tree in trees}
    stops: dict[str, list[float]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory(prefix="meshrun-train-start-") as tmp:
        work = Path(tmp)
        for i in range(args.repeats):
            for tree, src in trees.items():
                runs[tree].append(one_run(work, f"{tree}-{i}", src, args.timeout))
                if args.stop:
                    stops[tree].append(one_stop(work, f"{tree}-stop-{i}", src, args.timeout))
    print(f"meshrun train tiny.toml, 1 step, 2 processes; medians of {args.repeats}; "
          f"load average {Path('/proc/loadavg').read_text().split()[:3]}")
    medians = {}
    for tree in trees:
        wall = statistics.median(r[0] for r in runs[tree])
        cpu = statistics.median(r[1] for r in runs[tree])
        stop = statistics.median(stops[tree]) if args.stop else None
        medians[tree] = (wall, cpu, stop)
        print(f"  {tree:<7} wall {wall:6.2f} s   CPU {cpu:6.2f} s"
              + (f"   Ctrl-C to exit {stop:6.2f} s" if stop is not None else ""))
    if args.before:
        (wall_a, cpu_a, stop_a), (wall_b, cpu_b, stop_b) = medians["after"], medians["before"]
        print(f"  after/before: wall {wall_a / wall_b:.3f}, CPU {cpu_a / cpu_b:.3f}"
              + (f", Ctrl-C to exit {stop_a / stop_b:.3f}" if args.stop else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
