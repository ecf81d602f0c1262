"""Goodput under failures: `meshrun train` with a SIGKILL of a random worker every K seconds, next to the same run without.

    python benchmarks/goodput.py                               # 10 minutes a run, a kill every 60 s
    python benchmarks/goodput.py --minutes 0.5 --kill-every 10 --skip-baseline
    python benchmarks/goodput.py --side-by-side                # each pair at once: for a shared machine

1. Calibration (about 20 s): a fault-free `meshrun train` (2 processes, examples/configs/tiny.toml, checkpoint.interval 5)
   gives its steps/s, hence S = the steps a fault-free run does in --minutes.
2. meshrun, S steps without faults, then the same S steps with a SIGKILL of a random worker every --kill-every s, once
   the job has completed a step since the last recovery began (--max-restarts large enough). Goodput = useful tokens/s
   with faults / without = (launch -> step S, fault-free) / (launch -> step S, with kills); model.pt bitwise equal.
   --side-by-side starts the two runs together, sharing the machine and whatever else loads it; goodput is then the
   faulty run's step when the fault-free one ended, divided by S (the same seconds for both).
3. The guide's way, the same two runs: plain `torchrun` + DCP every checkpoint.interval steps (benchmarks/torchrun_dcp.py).

Each recovery is split, from the kill time, /proc and what the run writes (events.jsonl, rank 0's metrics.jsonl rows,
one per step), into the parts issue 15 names:
  detect    kill -> the surviving worker has exited (the agent's poll, SIGTERM to the survivor)
  rdzv      -> the new workers' processes exist (the agent's rendezvous round, then fork or exec)
  start     -> meshrun's worker entry has read the config (a forked worker: ~0; exec'd: Python's start)
  imports   -> torch imported (a pre-imported worker: ~0, launch/preload.py)
  pg init   -> process group ready (init_process_group: the store, gloo's full mesh)
  build     -> model, data, optimizer built
  load      the state: the in-memory snapshot or the disk checkpoint, agreed and loaded
  first     -> the first completed step
  redo      steps recomputed (completed before the kill, done again)
  total     kill -> next completed step              (processes are bounded by timeouts, stopped by pid, never by name)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import _descendants, kill_tree, worker_pids  # noqa: E402 - the tests' process helpers: by pid, never by name

from meshrun.runtime.events import process_start_time  # noqa: E402
from meshrun.runtime.events import read as read_events  # noqa: E402

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
LENGTH_MARGIN = 1.15  # --minutes is a floor: a 15 s calibration misjudged long runs' rate by up to 10% here
PARTS = ("detect", "rdzv", "start", "imports", "pg init", "build", "load", "first", "redo", "total")


def meshrun_cmd(run_root: Path, name: str, steps: int, interval: int, restarts: int, extra: list[str]) -> list[str]:
    return [str(BIN / "meshrun"), "train", str(REPO / "examples/configs/tiny.toml"), "--nproc-per-node", "2",
            "--max-restarts", str(restarts), "--set", f"train.name={name}", "--set", f"train.run_dir={run_root}",
            "--set", f"train.steps={steps}", "--set", "train.eval_interval=0", "--set", "metrics.interval=1",
            "--set", "train.log_interval=100000", "--set", f"checkpoint.interval={interval}", *extra]


def baseline_cmd(run_dir: Path, steps: int, interval: int, restarts: int) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--max-restarts", str(restarts),
            str(REPO / "benchmarks/torchrun_dcp.py"), "--run-dir", str(run_dir), "--steps", str(steps),
            "--interval", str(interval)]


def _workers(agent: int, marker: str | None) -> list[int]:
    """meshrun's workers (marker None: Popen'd or forked, conftest.worker_pids), or those whose cmdline has marker."""
    if marker is None:
        return worker_pids(agent)
    found = []
    for pid in _descendants(agent):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:
            pass
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _train_rows(run_dir: Path) -> list[dict]:
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
            _stop(proc)
    if finished and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {proc.returncode}; see {log}")
    return {"launched": launched, "kills": kills, "finished": finished}


def run(cmd: list[str], run_dir: Path, *, marker: str | None, kill_every: float | None, timeout: float,
        log: Path) -> dict:
    """Start cmd, SIGKILL a random worker every kill_every seconds, wait for the end; kill records."""
    run_dir.mkdir(parents=True, exist_ok=True)

    def act(pid: int, kills: list, rng: random.Random, due: bool, deadline: float) -> bool:
        if not (due and _stepped_since(run_dir, kills)):
            return False
        kill = _kill_one(pid, marker, rng, deadline)
        if kill is not None:
            kills.append(kill)
        return True

    done = supervise(cmd, run_dir.name, kill_every=kill_every, timeout=timeout, log=log, act=act)
    rows = _train_rows(run_dir)
    if not rows:
        raise RuntimeError(f"{' '.join(cmd[:3])} completed no step; see {log}")
    last = max(rows, key=lambda r: r["step"])
    return {**done, "rows": rows, "events": read_events(run_dir), "end": last["time"], "steps": last["step"]}


def pair(clean: dict, faulty: dict, together: bool, run_fn=None) -> tuple[dict, dict]:
    """run_fn(**clean) then run_fn(**faulty) (run_fn: run), or both at once (--side-by-side): the same load for both."""
    run_fn = run_fn or run
    if not together:
        return run_fn(**clean), run_fn(**faulty)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_fn, **clean), pool.submit(run_fn, **faulty)]
        return futures[0].result(), futures[1].result()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first (meshrun train then removes its /dev/shm directory), SIGKILL of the tree after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # not reaped yet, so the pid is still this process's
            proc.wait()


def _stepped_since(run_dir: Path, kills: list[dict]) -> bool:
    """A step completed since the last recovery began: never kill a job that has not recovered yet."""
    rows = _train_rows(run_dir)
    return bool(rows) and (not kills or rows[-1]["time"] > kills[-1]["started"])


def _kill_one(agent: int, marker: str | None, rng: random.Random, deadline: float) -> dict | None:
    """SIGKILL one worker; poll /proc until the survivors exit and new workers start."""
    workers = _workers(agent, marker)
    if len(workers) < 2:
        return None  # a restart is under way: no kill now
    victim = rng.choice(workers)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    survivors = [p for p in workers if p != victim]
    exited = None
    while time.time() < deadline:
        now = time.time()
        if exited is None and all(_gone(p) for p in survivors):
            exited = now
        fresh = [p for p in _workers(agent, marker) if p not in workers]
        if exited is not None and fresh:
            starts = [s for s in map(process_start_time, fresh) if s is not None]
            return {"at": killed_at, "survivors_exited": exited, "started": min(starts) if starts else now}
        time.sleep(0.01)
    return None


def breakdown(result: dict) -> list[dict]:
    """Per kill: the seconds of each part (see the module docstring)."""
    rows, events, out = result["rows"], result["events"], []
    for kill in result["kills"]:
        after = [e for e in events if e["time"] >= kill["started"] - 0.05]

        def first_all(name: str, after=after) -> float | None:  # every rank of the new start has got there
            times = [e["time"] for e in after if e["event"] == name]
            return max(times[:2]) if len(times) >= 2 else None

        names = ("worker_start", "torch_imported", "pg_ready", "checkpointer_ready", "resumed", "first_step")
        begun, imported, pg, built, loaded, stepped = (first_all(n) for n in names)
        if begun is None:  # the baseline script has no separate import events
            begun = imported = kill["started"]
        resumed = next((e for e in after if e["event"] == "resumed" and e["rank"] == 0), None)
        done = [r["step"] for r in rows if r["time"] <= kill["survivors_exited"]]
        if None in (imported, pg, built, loaded, stepped) or resumed is None:
            continue
        out.append({"detect": kill["survivors_exited"] - kill["at"], "rdzv": kill["started"] - kill["survivors_exited"],
                    "start": begun - kill["started"], "imports": imported - begun, "pg init": pg - imported,
                    "build": built - pg, "load": loaded - built, "first": stepped - loaded,
                    "redo": max(done or [0]) - resumed["step"], "total": stepped - kill["at"],
                    "source": resumed.get("source")})
    return out


def summary(name: str, clean: dict, faulty: dict, together: bool = False, minutes: float | None = None) -> None:
    clean_s = clean["end"] - clean["launched"]
    faulty_s = faulty["end"] - faulty["launched"]
    short = short_run_note(clean_s, minutes) if minutes else None
    parts = breakdown(faulty)
    if together:  # the same seconds of the same machine, until the first run ended: the steps each reached
        window = min(clean_s, faulty_s)

        def reached(result: dict) -> int:
            return max([r["step"] for r in result["rows"] if r["time"] - result["launched"] <= window] or [0])

        goodput = reached(faulty) / reached(clean)
        print(f"{name}: goodput {goodput:.3f} (side by side, the first {window:.1f} s from launch: step "
              f"{reached(clean)} without faults, step {reached(faulty)} with {len(faulty['kills'])} SIGKILLs; the runs "
              f"ended at {clean_s:.1f} and {faulty_s:.1f} s)")
    else:
        goodput = (faulty["steps"] / faulty_s) / (clean["steps"] / clean_s)
        print(f"{name}: goodput {goodput:.3f} (launch -> step {clean['steps']}: {clean_s:.1f} s without faults; "
              f"-> step {faulty['steps']}: {faulty_s:.1f} s with {len(faulty['kills'])} SIGKILLs)")
    if short:
        print(short)
    chosen = [e for e in faulty["events"] if e["event"] == "snapshot_interval" and e["rank"] == 0]
    if chosen:
        last = chosen[-1]
        print(f"  snapshots every {last['interval']} steps ('auto': one took {last['cost_s'] * 1e3:.1f} ms, "
              f"a step {last['step_s'] * 1e3:.1f} ms)")
    if not parts:
        return
    # SIGKILL -> the next completed step, then the steps redone, at the fault-free run's step time
    lost = sum(p["total"] for p in parts) + sum(p["redo"] for p in parts) * clean_s / clean["steps"]
    print(f"  in recoveries: {lost:.1f} s of {faulty_s:.1f} s ({lost / faulty_s:.1%}), i.e. goodput "
          f"{1 - lost / faulty_s:.3f} from the faulty run's own time (load-independent; snapshot cost not counted)")
    sources = {p["source"] for p in parts}
    print(f"  {len(parts)} recoveries, resumed from {', '.join(sorted(str(s) for s in sources))}; median (min-max), s:")
    for part in PARTS:
        values = [p[part] for p in parts]
        unit = " steps" if part == "redo" else ""
        print(f"    {part:8s} {statistics.median(values):6.2f}{unit} ({min(values):.2f}-{max(values):.2f})")


def calibrate(work: Path, interval: int, seconds: float, *, runs: int = 1, cmd_of=None, rows_of=_train_rows,
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
            rates = [_steady_rate(rows_of(work / name), seconds) for name in names]
            if all(rate is not None for rate in rates):
                return statistics.mean(rates)
            time.sleep(0.2)
    finally:
        for proc in procs:
            _stop(proc)
    raise RuntimeError(f"calibration never got going; see {work / names[0]}.log")


def _steady_rate(rows: list[dict], seconds: float) -> float | None:
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


def same_weights(a: Path, b: Path) -> bool:
    import torch
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` too: the finally blocks stop the runs
    work = Path(tempfile.mkdtemp(prefix="meshrun-goodput-"))
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}; work dir {work}")
    if args.mode == "torchft":
        import goodput_torchft
        return goodput_torchft.main(args, work)  # the torchft mode's runs, summary and clean-up
    try:
        steps = calibrated_steps(args, lambda runs: calibrate(work, args.interval, 15, runs=runs))
        together = args.side_by_side
        limit = args.minutes * 60 * 3 + 60  # each run: a faulty one may take 3x the fault-free time
        restarts = int(limit / args.kill_every) + 2
        extra = [x for kv in args.set for x in ("--set", kv)]
        print(f"{steps} steps a run (2 processes, tiny model, checkpoint.interval {args.interval}), "
              f"a SIGKILL every {args.kill_every:g} s")
        clean, faulty = pair(
            {"cmd": meshrun_cmd(work, "clean", steps, args.interval, 0, extra), "run_dir": work / "clean",
             "marker": None, "kill_every": None, "timeout": limit, "log": work / "clean.log"},
            {"cmd": meshrun_cmd(work, "faulty", steps, args.interval, restarts, extra), "run_dir": work / "faulty",
             "marker": None, "kill_every": args.kill_every, "timeout": limit, "log": work / "faulty.log"}, together)
        summary("meshrun (exact)", clean, faulty, together, None if args.steps else args.minutes)
        equal = clean["finished"] and faulty["finished"] and same_weights(work / "clean" / "model.pt",
                                                                          work / "faulty" / "model.pt")
        if clean["finished"] and faulty["finished"]:
            print(f"  final model.pt bitwise equal to the fault-free run's: {'yes' if equal else 'NO'}")
        if args.disk_only_too:
            disk = run(meshrun_cmd(work, "disk-only", steps, args.interval, restarts,
                                   [*extra, "--set", "checkpoint.snapshot_interval=0"]), work / "disk-only",
                       marker=None, kill_every=args.kill_every, timeout=limit, log=work / "disk-only.log")
            summary("meshrun (exact), disk checkpoints only", clean, disk)
        if not args.skip_baseline:
            base_clean, base_faulty = pair(
                {"cmd": baseline_cmd(work / "base-clean", steps, args.interval, 0), "run_dir": work / "base-clean",
                 "marker": "torchrun_dcp.py", "kill_every": None, "timeout": limit, "log": work / "base-clean.log"},
                {"cmd": baseline_cmd(work / "base-faulty", steps, args.interval, restarts),
                 "run_dir": work / "base-faulty", "marker": "torchrun_dcp.py", "kill_every": args.kill_every,
                 "timeout": limit, "log": work / "base-faulty.log"}, together)
            summary("torchrun + DCP (the guide's way)", base_clean, base_faulty, together)  # meshrun's step count: its own length
        print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not equal:  # a run that did not finish cannot show it either
        print("goodput.py: meshrun's final model.pt is not shown bitwise equal to the fault-free run's: exit 1")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
