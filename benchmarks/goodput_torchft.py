"""Goodput of `[fault] mode = "torchft"`: a SIGKILL of a random replica group's worker every K seconds.

    python benchmarks/goodput.py --mode torchft --minutes 3 --kill-every 30

The same fixed-step job twice, `meshrun train` on examples/configs/tiny.toml with 2 replica groups
of 1 process each (fault.heartbeat_timeout_ms at its default, checkpoint.interval --interval):
once without faults, once with a SIGKILL of the worker of a random group every --kill-every
seconds (only once every group is back in the quorum: the last kill's group has committed a
step together with the others). The step count S is calibrated first to --minutes of a
fault-free run.

Useful work, precisely: the samples of the committed steps, as the data ledger counts them
(meshrun.fault.ledger.account over `<run dir>/torchft/ledger-g*.jsonl`: each committed step's
slice of the epoch's order, a step committed by two lineages counted once, uncommitted steps
not at all). A step committed while a group is away takes fewer samples (the survivors split
the global order among themselves), so a run with faults commits S steps but fewer samples.
Goodput = (committed samples / s with faults) / (committed samples / s without), each from
launch to the time the last step was committed.

Each recovery, from the kill time, /proc and the records the groups write (events.jsonl,
ledger rows):
  restart  kill -> the killed group's new worker process exists (its agent's detection and restart)
  init     -> the new worker's Manager is up (imports, model build, torchft Manager)
  heal     -> healed: quorum with the survivors and their state received (the heal event)
  joint    -> the first step the healed group committed with every group (participants = all)
  total    kill -> first joint step
  pause    the survivor's longest gap between two commits in that window
  alone    steps the survivor committed with fewer groups in that window
Survivors must not restart: the other group's worker pid is the same before and after each
kill, and no group starts more often than it was killed. Processes are stopped by pid only.
"""

from __future__ import annotations

import json
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
    calibrated_steps,
    gone,
    goodput_parser,
    pair,
    short_run_note,
    supervise,
)
from common import calibrate as calibrate_steps

from meshrun.fault import ledger
from meshrun.runtime.events import process_start_time

GROUPS = 2
QUIET_TAIL_STEPS = 20  # no kill this close to the end: a heal took up to 9 of the survivor's steps under load
QUIET_TAIL_S = 6.0  # nor this close at the run's pace (or twice the longest recovery yet): a replacement started
# under load can take seconds, and one back after the survivors finished has nobody to heal from (it stops)
ALONE_SPEEDUP = 2.0  # how much faster than the groups' joint pace a survivor alone may train
PARTS = ("restart", "init", "heal", "joint", "total", "pause", "alone")


def torchft_cmd(run_root: Path, name: str, steps: int, interval: int, restarts: int, extra: list[str]) -> list[str]:
    return [str(BIN / "meshrun"), "train", str(REPO / "examples/configs/tiny.toml"), "--max-restarts", str(restarts),
            "--set", "fault.mode=torchft", "--set", f"fault.replica_groups={GROUPS}", "--set", "fault.group_size=1",
            "--set", f"train.name={name}", "--set", f"train.run_dir={run_root}", "--set", f"train.steps={steps}",
            "--set", "train.eval_interval=0", "--set", "metrics.interval=1", "--set", "train.log_interval=100000",
            "--set", f"checkpoint.interval={interval}", *extra]


def _records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    records = run_dir / "torchft"
    if not records.exists():
        return [], []
    return ledger.read_ledgers(records), ledger.read_events(records)


def _current(events: list[dict]) -> dict[int, int]:
    """group -> the pid of its newest worker (local rank 0: a group of one process)."""
    return {e["group"]: e["pid"] for e in sorted(events, key=lambda e: e["time"]) if e["event"] == "start"}


def _all_joined(rows: list[dict], events: list[dict], since: float) -> bool:
    """Every group's newest worker has committed a step with every group after `since`."""
    pids = _current(events)
    return len(pids) == GROUPS and all(
        any(r["pid"] == pid and r["participants"] == GROUPS and r["time"] > since for r in rows)
        for pid in pids.values())


def run(cmd: list[str], run_dir: Path, *, kill_every: float | None, timeout: float, log: Path,
        steps: int | None = None) -> dict:
    """Start cmd, SIGKILL a random group's worker every kill_every seconds, wait for the end.
    No kill in the last QUIET_TAIL_STEPS of `steps`: a group killed there could not heal before the
    survivors finish, and its recovery would be counted as lost."""

    def act(pid: int, kills: list, rng: random.Random, due: bool, deadline: float) -> bool:
        rows, events = _records(run_dir)
        _note_restarts(kills, events)
        if not _all_joined(rows, events, kills[-1]["at"] if kills else 0):
            return False
        if kills and "joined" not in kills[-1]:
            kills[-1]["joined"] = time.time()  # about: seen within the supervisor's poll
        if not due:
            return False
        if steps and rows and max(r["step"] for r in rows) >= steps - QUIET_TAIL_STEPS:
            return False
        longest = max((k["joined"] - k["at"] for k in kills), default=0.0)
        # The pace is the groups' together; a survivor alone runs up to twice as fast (on 2 cores, one
        # process instead of two), so the end can come in half the time the pace says (a suite run:
        # a kill 6 s before the end at the joint pace, the survivor finished before the group was back).
        if steps and _seconds_left(rows, steps) / ALONE_SPEEDUP < max(QUIET_TAIL_S, 2 * longest):
            return False
        pids = _current(events)
        group = rng.randrange(GROUPS)
        if not gone(pids[group]):
            kills.append({"at": time.time(), "group": group, "pid": pids[group], "others": pids})
            os.kill(pids[group], signal.SIGKILL)
        return True

    done = supervise(cmd, run_dir.name, kill_every=kill_every, timeout=timeout, log=log, act=act)
    kills = done["kills"]
    (run_dir / "kills.json").write_text(json.dumps(kills) + "\n")  # with the records: the summary can be redone
    rows, events = _records(run_dir)
    if not rows:
        raise RuntimeError(f"{' '.join(cmd[:3])} committed no step; see {log}")
    return {**done, "rows": rows, "events": events,
            "end": max(r["time"] for r in rows), "steps": max(r["step"] for r in rows),
            "acc": ledger.account(rows, GROUPS, events)}


def _seconds_left(rows: list[dict], steps: int) -> float:
    """The seconds until step `steps` at the pace of the last 10 committed steps."""
    last = sorted({r["step"]: r["time"] for r in sorted(rows, key=lambda r: r["time"])}.items())[-10:]
    if len(last) < 2:
        return float("inf")
    pace = (last[-1][1] - last[0][1]) / (last[-1][0] - last[0][0])
    return (steps - last[-1][0]) * pace


def _note_restarts(kills: list[dict], events: list[dict]) -> None:
    """The process start time of each killed group's replacement, read from /proc while it lives."""
    for kill in kills:
        if "started" in kill:
            continue
        new = [e for e in events if e["event"] == "start" and e["group"] == kill["group"] and e["time"] > kill["at"]]
        if new:
            kill["started"] = process_start_time(new[0]["pid"])


def breakdown(result: dict) -> list[dict]:
    """Per kill: the seconds of each part (see the module docstring), and whether a survivor restarted."""
    rows, events, out = result["rows"], result["events"], []
    for kill in result["kills"]:
        at, group = kill["at"], kill["group"]
        start = next((e for e in events if e["event"] == "start" and e["group"] == group and e["time"] > at), None)
        joint = next((r for r in sorted(rows, key=lambda r: r["time"]) if start and r["pid"] == start["pid"]
                      and r["participants"] == GROUPS), None)
        if start is None or joint is None:
            out.append({"unrecovered": True, "group": group, "at": at})
            continue
        # No heal when the new worker resumed from its own checkpoint at the survivor's step (the
        # survivor had waited at the quorum since): the heal part is then 0.
        heal = next((e for e in events if e["event"] == "heal" and e["group"] == group
                     and start["time"] <= e["time"] <= joint["time"]), {"time": start["time"]})
        survivors = {g: pid for g, pid in kill["others"].items() if g != group}
        window = [r for r in rows if r["group"] in survivors and r["time"] > at and r["step"] <= joint["step"]]
        restarted = any(e["event"] == "start" and e["group"] in survivors and at < e["time"] <= joint["time"]
                        for e in events) or any(r["pid"] != survivors[r["group"]] for r in window)
        # The survivor's longest wait between two commits, from its last commit before the kill
        # to the joint step's (a survivor may wait out the whole recovery without committing).
        before = [r["time"] for r in rows if r["group"] in survivors and r["time"] <= at]
        times = sorted([*before[-1:], *(r["time"] for r in window)])
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        began = kill.get("started") or start["time"]
        out.append({"restart": began - at, "init": start["time"] - began, "heal": heal["time"] - start["time"],
                    "joint": joint["time"] - heal["time"], "total": joint["time"] - at,
                    "pause": max(gaps, default=0.0),
                    "alone": sum(1 for r in window if r["participants"] < GROUPS),
                    "group": group, "at": at, "survivor_restarted": restarted})
    return out


def _samples(row: dict) -> int:
    if row["epoch0"] == row["epoch1"]:
        return row["pos1"] - row["pos0"]
    return row.get("end0", row["epoch_end"]) - row["pos0"] + row["pos1"]


def _committed_samples(result: dict, within: float | None = None) -> int:
    """Samples of the run's committed steps (each step once: its last commit), those within `within` s of launch."""
    last = {}
    for row in sorted(result["rows"], key=lambda r: r["time"]):
        if within is None or row["time"] - result["launched"] <= within:
            last[row["step"]] = row
    return sum(_samples(r) for r in last.values())


def own_rate_goodput(result: dict, parts: list[dict]) -> tuple[float, float, float]:
    """(goodput against the faulty run's own committed samples/s outside its recoveries, seconds in
    recoveries, that rate): robust to the machine's load changing between the two runs."""
    last = {}
    for row in sorted(result["rows"], key=lambda r: r["time"]):
        last[row["step"]] = row
    rows = sorted(last.values(), key=lambda r: r["time"])
    first, end = rows[0]["time"], rows[-1]["time"]
    windows = [(p["at"], p["at"] + p["total"] if "total" in p else end) for p in parts]
    inside = lambda t: any(a <= t <= b for a, b in windows)  # noqa: E731
    lost = sum(min(b, end) - max(a, first) for a, b in windows if b > first and a < end)
    out_samples = sum(_samples(r) for r in rows[1:] if not inside(r["time"]))
    rate = out_samples / max(end - first - lost, 1e-9)
    return sum(_samples(r) for r in rows[1:]) / (end - first) / rate, lost, rate


def summary(clean: dict, faulty: dict, together: bool = False) -> bool:
    """Print the pair's figures; True when the checks held (no survivor restarted, both ledgers exact)."""
    clean_s, faulty_s = clean["end"] - clean["launched"], faulty["end"] - faulty["launched"]
    ca, fa = clean["acc"], faulty["acc"]
    if together:  # side by side: committed samples in the same seconds of the same machine, until the first ended
        window = min(clean_s, faulty_s)  # a faulty run commits fewer samples a step while a group is away
        reached, total = _committed_samples(faulty, within=window), _committed_samples(clean, within=window)
        print(f"meshrun (torchft, side by side): goodput {reached / total:.3f} in committed samples (the first "
              f"{window:.1f} s from launch: {total} without faults, {reached} with {len(faulty['kills'])} SIGKILLs)")
    goodput = (fa.samples / faulty_s) / (ca.samples / clean_s)
    steps_ratio = (faulty["steps"] / faulty_s) / (clean["steps"] / clean_s)
    print(f"meshrun (torchft, {GROUPS} groups x 1): goodput {goodput:.3f} in committed samples/s "
          f"({ca.samples} samples in {clean_s:.1f} s without faults; {fa.samples} in {faulty_s:.1f} s with "
          f"{len(faulty['kills'])} SIGKILLs); in committed steps/s {steps_ratio:.3f}")
    parts = breakdown(faulty)
    own, lost, rate = own_rate_goodput(faulty, parts)
    print(f"  against its own rate outside recoveries ({rate:.0f} samples/s; {ca.samples / clean_s:.0f} without faults, "
          f"the machine's load moves it): goodput {own:.3f}, {lost:.1f} s of {faulty_s:.1f} s in recoveries")
    done = [p for p in parts if not p.get("unrecovered")]
    lost = [p["group"] for p in parts if p.get("unrecovered")]
    if done:
        print(f"  {len(done)} recoveries{f' ({len(lost)} not recovered by the end)' if lost else ''}; "
              "median (min-max), s:")
        for part in PARTS:
            values = [p[part] for p in done]
            unit = " steps" if part == "alone" else ""
            print(f"    {part:8s} {statistics.median(values):6.2f}{unit} ({min(values):.2f}-{max(values):.2f})")
        for i, p in enumerate(done):
            print(f"    kill {i + 1} (group {p['group']}): " + ", ".join(f"{k} {p[k]:.2f}" for k in PARTS))
    starts = {g: sum(1 for e in faulty["events"] if e["event"] == "start" and e["group"] == g) for g in range(GROUPS)}
    killed = {g: sum(1 for k in faulty["kills"] if k["group"] == g) for g in range(GROUPS)}
    restarted = any(p.get("survivor_restarted") for p in done) or any(starts[g] > 1 + killed[g] for g in starts)
    print(f"  survivors restarted: {'NO survivor restarted' if not restarted else 'YES'} "
          f"(starts per group {starts}, kills per group {killed}; survivor pid unchanged across each kill)")
    for name, run in (("without faults", clean), ("with faults", faulty)):
        acc = run["acc"]
        extra = f", {acc.superseded} step(s) committed again by the surviving lineage" if acc.superseded else ""
        print(f"  {name}: {ledger.describe(acc)}{extra}")
    return not restarted and all(r["acc"].exact and not r["acc"].weights_differ for r in (clean, faulty))


def calibrate(work: Path, interval: int, seconds: float, runs: int) -> float:
    """Committed steps/s of a fault-free torchft run (group 0's rows), steady state; `runs` at once."""
    return calibrate_steps(
        work, interval, seconds, runs=runs, cmd_of=lambda name: torchft_cmd(work, name, 1_000_000, interval, 0, []),
        bound=180,
        rows_of=lambda run_dir: sorted((r for r in _records(run_dir)[0] if r["group"] == 0), key=lambda r: r["time"]))


def main() -> int:
    """`goodput.py --mode torchft` (goodput.py hands over to this script with the same flags): the two runs
    and their summary, then the work dir goes."""
    args = goodput_parser(__doc__.splitlines()[0]).parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` too: the finally blocks stop the runs
    work = Path(tempfile.mkdtemp(prefix="meshrun-goodput-"))
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}; work dir {work}")
    try:
        return _main(args, work)
    finally:
        print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _main(args, work: Path) -> int:
    steps = calibrated_steps(args, lambda runs: calibrate(work, args.interval, 15, runs))
    limit = args.minutes * 60 * 3 + 60
    restarts = int(limit / args.kill_every) + 2
    extra = [x for kv in args.set for x in ("--set", kv)]
    workers = "exec'd (MESHRUN_PRELOAD=0)" if os.environ.get("MESHRUN_PRELOAD") == "0" else "forked, torch preloaded"
    print(f"{steps} steps a run (torchft: {GROUPS} replica groups x 1 process, tiny model, checkpoint.interval "
          f"{args.interval}, workers {workers}), a SIGKILL of a random group's worker every {args.kill_every:g} s")
    clean, faulty = pair(
        {"cmd": torchft_cmd(work, "clean", steps, args.interval, 0, extra), "run_dir": work / "clean",
         "kill_every": None, "timeout": limit, "log": work / "clean.log"},
        {"cmd": torchft_cmd(work, "faulty", steps, args.interval, restarts, extra), "run_dir": work / "faulty",
         "kill_every": args.kill_every, "timeout": limit, "log": work / "faulty.log", "steps": steps},
        args.side_by_side, run)
    held = summary(clean, faulty, args.side_by_side)
    short = None if args.steps else short_run_note(clean["end"] - clean["launched"], args.minutes)
    if short:
        print(short)
    if not held:
        print("goodput.py: a check failed (a survivor restarted, or a sample was lost or seen twice): exit 1")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
