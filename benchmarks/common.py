"""What the benchmarks share: the repository, the venv's commands, and running a job under faults.

Process trees are stopped by pid, never by name (meshrun.testing.processes). The goodput pair
(`goodput.py`, `goodput_torchft.py`) runs its jobs through `supervise`, `pair` and `calibrate`.
Every benchmark imports its shared helpers from here, and this module imports no benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from meshrun.testing.processes import kill_tree

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
LENGTH_MARGIN = 1.15  # --minutes is a floor: a 15 s calibration misjudged long runs' rate by up to 10% here


def run_bounded(cmd: list[str], timeout: float, what: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit code, stdout and stderr together) of `cmd`, run in a session of its own; past `timeout`
    its whole process group (a launcher and its workers) is SIGKILLed and the benchmark stops with
    one line naming `what`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"{what}: did not finish within {timeout}s") from None
    return proc.returncode, out


def meshrun_cmd(run_root: Path, name: str, steps: int, interval: int, restarts: int, extra: list[str]) -> list[str]:
    return [str(BIN / "meshrun"), "train", str(REPO / "examples/configs/tiny.toml"), "--nproc-per-node", "2",
            "--max-restarts", str(restarts), "--set", f"train.name={name}", "--set", f"train.run_dir={run_root}",
            "--set", f"train.steps={steps}", "--set", "train.eval_interval=0", "--set", "metrics.interval=1",
            "--set", "train.log_interval=100000", "--set", f"checkpoint.interval={interval}", *extra]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def train_rows(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a row still being written
            pass
    return [row for row in rows if row.get("kind") == "train"]


def supervise(cmd: list[str], name: str, *, kill_every: float | None, timeout: float, log: Path, act) -> dict:
    """Start cmd (its own session, output to log) and wait for its end, stopping it past timeout.

    Every poll, act(pid, kills, rng, due, deadline) may SIGKILL a worker (appending to kills); due
    says kill_every has passed since the last try; act returns True when it tried. Both modes use it.
    """
    with open(log, "w") as out:
        launched = time.time()
        proc = subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        kills, rng, finished = [], random.Random(0), False
        try:
            next_kill = launched + (kill_every or 0)
            while not finished:
                finished = proc.poll() is not None
                if not finished and time.time() > launched + timeout:
                    print(f"  {name}: stopped unfinished after {timeout:.0f} s (--minutes bounds each run)")
                    break
                if act(proc.pid, kills, rng, bool(kill_every) and time.time() >= next_kill, launched + timeout):
                    next_kill = max(next_kill + kill_every, time.time() + 1)
                time.sleep(0.05)
        finally:
            stop(proc)
    if finished and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {proc.returncode}; see {log}")
    return {"launched": launched, "kills": kills, "finished": finished}


def pair(clean: dict, faulty: dict, together: bool, run_fn) -> tuple[dict, dict]:
    """run_fn(**clean) then run_fn(**faulty), or both at once (--side-by-side): the same load for both."""
    if not together:
        return run_fn(**clean), run_fn(**faulty)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_fn, **clean), pool.submit(run_fn, **faulty)]
        return futures[0].result(), futures[1].result()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM first (meshrun train then removes its /dev/shm directory), SIGKILL of the tree after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # not reaped yet, so the pid is still this process's
            proc.wait()


def calibrate(work: Path, interval: int, seconds: float, *, runs: int = 1, cmd_of=None, rows_of=train_rows,
              bound: float = 120) -> float:
    """Steps/s of a fault-free run (meshrun's unless cmd_of(name) gives the command), steady state (after its
    first 5 steps); rows_of(run_dir): its step rows in time order. runs=2 (--side-by-side): two such runs at
    once, as the measured pairs run, and the mean of their rates (two jobs on this machine each get more than
    half of one alone: the tiny model's 2 ranks leave the cores idle while they wait on each other)."""
    cmd_of = cmd_of or (lambda name: meshrun_cmd(work, name, 1_000_000, interval, 0, []))
    names = [f"calibrate-{i}" for i in range(runs)]
    procs = []
    try:
        for name in names:
            with open(work / f"{name}.log", "w") as out:
                procs.append(subprocess.Popen(cmd_of(name), env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.time() + bound
        while time.time() < deadline and all(proc.poll() is None for proc in procs):
            rates = [steady_rate(rows_of(work / name), seconds) for name in names]
            if all(rate is not None for rate in rates):
                return statistics.mean(rates)
            time.sleep(0.2)
    finally:
        for proc in procs:
            stop(proc)
    raise RuntimeError(f"calibration never got going; see {work / names[0]}.log")


def steady_rate(rows: list[dict], seconds: float) -> float | None:
    """Steps/s over rows[5:], once they span `seconds`; None before."""
    if len(rows) > 5 and rows[-1]["time"] - rows[5]["time"] >= seconds:
        return (rows[-1]["step"] - rows[5]["step"]) / (rows[-1]["time"] - rows[5]["time"])
    return None


def calibrated_steps(args, rate_of) -> int:
    """--steps, or the steps a fault-free run does in --minutes x LENGTH_MARGIN; rate_of(runs) calibrates
    with `runs` runs at once (2 with --side-by-side, as the measured pairs run)."""
    if args.steps:
        return args.steps
    return max(20, round(rate_of(2 if args.side_by_side else 1) * args.minutes * 60 * LENGTH_MARGIN))


def short_run_note(seconds: float, minutes: float) -> str | None:
    """A line when the fault-free run took under --minutes (the calibration's rate was off)."""
    if seconds < minutes * 60:
        return (f"  note: the fault-free run took {seconds:.0f} s, under the {minutes:g} minutes asked for (the "
                "machine sped up after the calibration); give --steps to fix the length")
    return None


def goodput_parser(description: str) -> argparse.ArgumentParser:
    """The goodput benchmarks' flags (goodput.py; --mode torchft runs goodput_torchft.py with the same)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--minutes", type=float, default=10,
                        help="wall time of a fault-free run, at least (default 10; calibrated with a 15%% margin); each run is stopped after 3x that + 1 min")
    parser.add_argument("--kill-every", type=float, default=60, help="seconds between SIGKILLs (default 60)")
    parser.add_argument("--interval", type=int, default=5, help="checkpoint.interval (disk), both ways (default 5)")
    parser.add_argument("--steps", type=int, help="steps of each run (default: calibrated to --minutes)")
    parser.add_argument("--skip-baseline", action="store_true", help="leave out the torchrun + DCP runs")
    parser.add_argument("--disk-only-too", action="store_true",
                        help="also the faulty meshrun run with checkpoint.snapshot_interval=0 (disk checkpoints only)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more meshrun config for both meshrun runs, e.g. checkpoint.snapshot_interval=0")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, run dirs)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run each fault-free run at the same time as its faulty run (half the machine each, "
                             "the same load from other jobs: the ratio holds on a shared machine)")
    parser.add_argument("--mode", choices=("exact", "torchft"), default="exact", help="fault.mode (default exact; torchft: goodput_torchft.py)")
    parser.add_argument("--kill-after-steps", type=int, default=1, metavar="N",
                        help="exact mode: kill only once the job has completed N steps since the last recovery "
                             "began (default 1; more keeps a short run moving on a loaded machine)")
    return parser
