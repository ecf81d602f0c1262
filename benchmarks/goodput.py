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
one per step), into these parts:
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

import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import (
    BIN,
    REPO,
    calibrate,
    calibrated_steps,
    gone,
    goodput_parser,
    meshrun_cmd,
    pair,
    short_run_note,
    supervise,
    train_rows,
)

from meshrun.runtime.events import process_start_time
from meshrun.runtime.events import read as read_events
from meshrun.testing.processes import descendants, worker_pids

PARTS = ("detect", "rdzv", "start", "imports", "pg init", "build", "load", "first", "redo", "total")


def baseline_cmd(run_dir: Path, steps: int, interval: int, restarts: int) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--max-restarts", str(restarts),
            str(REPO / "benchmarks/torchrun_dcp.py"), "--run-dir", str(run_dir), "--steps", str(steps),
            "--interval", str(interval)]


def _workers(agent: int, marker: str | None) -> list[int]:
    """meshrun's workers (marker None: Popen'd or forked, meshrun.testing.processes.worker_pids), or those whose cmdline has marker."""
    if marker is None:
        return worker_pids(agent)
    found = []
    for pid in descendants(agent):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:
            pass
    return found


def run(cmd: list[str], run_dir: Path, *, marker: str | None, kill_every: float | None, timeout: float,
        log: Path, kill_after_steps: int = 1) -> dict:
    """Start cmd, SIGKILL a random worker every kill_every seconds, wait for the end; kill records.
    A kill waits until the job has completed kill_after_steps steps since the last recovery began."""
    run_dir.mkdir(parents=True, exist_ok=True)

    def act(pid: int, kills: list, rng: random.Random, due: bool, deadline: float) -> bool:
        if not (due and _stepped_since(run_dir, kills, kill_after_steps)):
            return False
        kill = _kill_one(pid, marker, rng, deadline)
        if kill is not None:
            kills.append(kill)
        return True

    done = supervise(cmd, run_dir.name, kill_every=kill_every, timeout=timeout, log=log, act=act)
    rows = train_rows(run_dir)
    if not rows:
        raise RuntimeError(f"{' '.join(cmd[:3])} completed no step; see {log}")
    last = max(rows, key=lambda r: r["step"])
    return {**done, "rows": rows, "events": read_events(run_dir), "end": last["time"], "steps": last["step"]}


def _stepped_since(run_dir: Path, kills: list[dict], steps: int = 1) -> bool:
    """`steps` steps completed since the last recovery began: never kill a job that has not recovered yet."""
    rows = train_rows(run_dir)
    if not kills:
        return bool(rows)
    return sum(1 for row in rows if row["time"] > kills[-1]["started"]) >= steps


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
        if exited is None and all(gone(p) for p in survivors):
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


def same_weights(a: Path, b: Path) -> bool:
    import torch
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> int:
    args = goodput_parser(__doc__.splitlines()[0]).parse_args()
    if args.mode == "torchft":  # the torchft mode's own script, with the same flags (this process becomes it)
        script = str(Path(__file__).with_name("goodput_torchft.py"))
        os.execv(sys.executable, [sys.executable, script, *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` too: the finally blocks stop the runs
    work = Path(tempfile.mkdtemp(prefix="meshrun-goodput-"))
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}; work dir {work}")
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
             "marker": None, "kill_every": args.kill_every, "timeout": limit, "log": work / "faulty.log",
             "kill_after_steps": args.kill_after_steps}, together, run)
        summary("meshrun (exact)", clean, faulty, together, None if args.steps else args.minutes)
        equal = clean["finished"] and faulty["finished"] and same_weights(work / "clean" / "model.pt",
                                                                          work / "faulty" / "model.pt")
        if clean["finished"] and faulty["finished"]:
            print(f"  final model.pt bitwise equal to the fault-free run's: {'yes' if equal else 'NO'}")
        if args.disk_only_too:
            disk = run(meshrun_cmd(work, "disk-only", steps, args.interval, restarts,
                                   [*extra, "--set", "checkpoint.snapshot_interval=0"]), work / "disk-only",
                       marker=None, kill_every=args.kill_every, timeout=limit, log=work / "disk-only.log",
                       kill_after_steps=args.kill_after_steps)
            summary("meshrun (exact), disk checkpoints only", clean, disk)
        if not args.skip_baseline:
            base_clean, base_faulty = pair(
                {"cmd": baseline_cmd(work / "base-clean", steps, args.interval, 0), "run_dir": work / "base-clean",
                 "marker": "torchrun_dcp.py", "kill_every": None, "timeout": limit, "log": work / "base-clean.log"},
                {"cmd": baseline_cmd(work / "base-faulty", steps, args.interval, restarts),
                 "run_dir": work / "base-faulty", "marker": "torchrun_dcp.py", "kill_every": args.kill_every,
                 "timeout": limit, "log": work / "base-faulty.log", "kill_after_steps": args.kill_after_steps},
                together, run)
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
