"""`meshrun train` in torchft mode: the lighthouse here, one elastic agent per replica group.

    meshrun train --set fault.mode=torchft --set fault.replica_groups=2 --max-restarts 3

This process hosts torchft's lighthouse (`LighthouseServer`, its Rust quorum server, in a thread
of ours) and starts each replica group as its own `meshrun launch` child: its own torchrun agent,
rendezvous and store, `fault.group_size` workers, and `--max-restarts` restarts of its own. A
group whose worker dies is stopped and restarted by its agent while the other groups keep
stepping; the restarted workers heal from a peer (replica.py). Group 0 trains in the run
directory, group g > 0 in `<run dir>/replica-g/`; their records go to `<run dir>/torchft/`, and
the end summary (heals, restarts, steps each group committed, the data ledger's check) is
printed and written to `<run dir>/torchft/summary.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshrun.config import JobConfig
from meshrun.errors import ConfigError
from meshrun.extras import import_extra
from meshrun.fault import ledger
from meshrun.fault.settings import (
    GROUP_DIR,
    GROUP_ENV,
    LIGHTHOUSE_ENV,
    NUM_GROUPS_ENV,
    RECORDS_DIR,
    RECORDS_ENV,
)
from meshrun.rundir.runs import (
    CONFIG_FILE,
    FINAL_WEIGHTS,
    finished_step,
    set_aside_final,
    write_finished,
)

QUORUM_TICK_MS = 10  # how often the lighthouse re-checks a pending quorum
STOP_GRACE_S = 30.0  # after SIGTERM, how long a group's agent gets to stop its workers


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir if group == 0 else run_dir / GROUP_DIR.format(group=group)


# The launch flags each group's agent takes as the user gave them (on the command line or in [launch]),
# when not at their defaults. The others are the launcher's per group: --nproc-per-node is
# fault.group_size, --log-dir a folder per group, and nodes and rendezvous are each group's own.
GROUP_FLAGS = {"max_restarts": "--max-restarts", "monitor_interval": "--monitor-interval",
               "start_method": "--start-method", "redirects": "--redirects", "tee": "--tee",
               "local_ranks_filter": "--local-ranks-filter", "signals_to_handle": "--signals-to-handle",
               "shutdown_timeout": "--shutdown-timeout", "hang_timeout": "--hang-timeout", "debug": "--debug"}
GROUP_SWITCHES = {"rank0_only": "--rank0-only", "no_prefix": "--no-prefix", "verbose": "--verbose"}


def group_launch_flags(options) -> list[str]:
    """The user's per-group launch flags (GROUP_FLAGS, GROUP_SWITCHES) from `meshrun train`'s options."""
    from meshrun.launch.args import build_parser

    defaults = build_parser()
    flags = ["--max-restarts", str(options.max_restarts)]  # always: a group restarts on its own
    for dest, flag in GROUP_FLAGS.items():
        value = getattr(options, dest, None)
        if dest != "max_restarts" and value not in (None, "") and value != defaults.get_default(dest):
            flags += [flag, str(value)]
    return flags + [flag for dest, flag in GROUP_SWITCHES.items() if getattr(options, dest, False)]


def group_command(cfg: JobConfig, plan, run_dir: Path, group: int) -> list[str]:
    """`meshrun launch` of one group's workers: the worker arguments `meshrun train` chose, in its directory."""
    log_dir = Path(plan.log_dir or run_dir / "logs") / GROUP_DIR.format(group=group)
    worker_args = list(plan.options.training_script_args)  # --run-dir RUN_DIR --resume ... [--profile ...]
    worker_args[worker_args.index("--run-dir") + 1] = str(group_dir(run_dir, group))
    return [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", str(cfg.fault.group_size),
            *group_launch_flags(plan.options), "--log-dir", str(log_dir), "-m", "meshrun.fault.worker", *worker_args]


def reopen_group(gdir: Path) -> None:
    """A group directory that finished an earlier start of this run trains again: `meshrun train`
    let this start go ahead (the run unfinished, or --force set aside its final weights), and a
    finished group's workers would otherwise exit at once, leaving the others to train alone."""
    done = finished_step(gdir)
    if done is not None:
        set_aside_final(gdir, done)


def run_replica_groups(cfg: JobConfig, plan, run_dir: Path) -> int:
    """Run every replica group to its end under one lighthouse; the job's exit code."""
    # torchft's Rust servers log every quorum at INFO; warnings and errors only, unless RUST_LOG says.
    os.environ.setdefault("RUST_LOG", "warn")  # this process is the launcher: it ends with the job
    coordination = import_extra("torchft.coordination", "fault.mode = 'torchft'", error=ConfigError)
    fault = cfg.fault
    records = run_dir / RECORDS_DIR
    records.mkdir(exist_ok=True)
    ledger.record_event(records, "launch", groups=fault.replica_groups)  # events before it are an earlier start's
    lighthouse = coordination.LighthouseServer(
        bind="[::]:0", min_replicas=fault.min_replicas, join_timeout_ms=fault.join_timeout_ms,
        quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=fault.heartbeat_timeout_ms)
    print(f"meshrun train: torchft: {fault.replica_groups} replica groups x {fault.group_size} process(es), "
          f"lighthouse {lighthouse.address()}", file=sys.stderr)
    # As torchrun does for several processes: one intra-op thread each, unless the user said otherwise.
    # A group of one process gets no such default from its own agent, and threads that outnumber
    # the cores make every matmul wait (a tiny model's step went from 0.1 s to 1.7 s here).
    threads = {"OMP_NUM_THREADS": "1"} if fault.replica_groups * fault.group_size > 1 else {}
    env = {**threads, **os.environ, NUM_GROUPS_ENV: str(fault.replica_groups), LIGHTHOUSE_ENV: lighthouse.address(),
           RECORDS_ENV: str(records)}
    children: list[subprocess.Popen] = []
    started = time.time()
    stopped_by: list[int] = []

    def forward(signum, _frame) -> None:  # SIGTERM: every group's agent stops its workers, which save
        stopped_by.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        for group in range(fault.replica_groups):
            gdir = group_dir(run_dir, group)
            if group:
                gdir.mkdir(exist_ok=True)
                shutil.copyfile(run_dir / CONFIG_FILE, gdir / CONFIG_FILE)
                reopen_group(gdir)
            out = None if group == 0 else open(records / f"launch-g{group}.out", "ab")  # noqa: SIM115
            children.append(subprocess.Popen(group_command(cfg, plan, run_dir, group),
                                             env={**env, GROUP_ENV: str(group)}, stdout=out,
                                             stderr=subprocess.STDOUT if out else None))
        codes = [child.wait() for child in children]
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(children)
        lighthouse.shutdown()
    writer = publish_final_weights(run_dir, fault.replica_groups, cfg.train.steps)
    summary = summarize(records, fault.replica_groups, codes, seconds=time.time() - started, weights_by=writer)
    (records / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for line in summary["lines"]:
        print(f"meshrun train: torchft: {line}", file=sys.stderr)
    if summary["weights_differ"]:
        print(f"meshrun train: torchft: error: replica groups committed the same step with different weights "
              f"(steps {summary['weights_differ']}); the final weights are not trustworthy: see "
              f"{records / 'summary.json'} and the groups' logs", file=sys.stderr)
    return job_exit_code(codes, stopped_by[0] if stopped_by else None, writer, bool(summary["weights_differ"]))


def job_exit_code(codes: list[int], signum: int | None, writer: int | None, diverged: bool = False) -> int:
    """128 + the signal that stopped the job; 1 when groups committed a step with different weights
    (a broken run, whoever finished); 0 when a group finished the run (its weights are the run's: a
    group that gave up meanwhile is what torchft mode tolerates, and the summary names it); else the
    first group's non-zero exit code."""
    if signum is not None:
        return 128 + signum
    if diverged:
        return 1
    if writer is not None:
        return 0
    return next((code for code in codes if code), 0)


def _stop(children: list[subprocess.Popen]) -> None:
    """Stop the groups still running (the launcher was interrupted): SIGTERM, then SIGKILL."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def final_weights_group(finished: dict[int, int | None], steps: int) -> int | None:
    """The group whose model.pt is the run's: one that finished all `steps` (its finished.json says so;
    every step it committed was agreed in a quorum, so such groups hold the same weights), group 0
    when it did, else the lowest; None when no group finished. `finished`: group -> finished_step."""
    return min((group for group, step in finished.items() if step == steps), default=None)


def publish_final_weights(run_dir: Path, num_groups: int, steps: int) -> int | None:
    """Make `<run dir>/model.pt` the final weights of a group that finished, and return that group.

    Group 0 writes them there itself; when it did not finish (it ran out of restarts while the
    others trained on), a finished group's model.pt and finished.json are copied there (atomically,
    model.pt first, as the trainer writes them), so the run's result is where a user looks for it
    and a re-run of the same command sees a finished run."""
    finished = {group: finished_step(group_dir(run_dir, group)) for group in range(num_groups)}
    writer = final_weights_group(finished, steps)
    if writer:
        tmp = run_dir / (FINAL_WEIGHTS + ".tmp")
        shutil.copyfile(group_dir(run_dir, writer) / FINAL_WEIGHTS, tmp)
        os.replace(tmp, run_dir / FINAL_WEIGHTS)
        write_finished(run_dir, steps)
    return writer


def summarize(records: Path, num_groups: int, codes: list[int], *, seconds: float,
              weights_by: int | None = None) -> dict:
    """What the run's records say: per group its starts, heals and commits; the data check."""
    events = ledger.read_events(records)
    acc = ledger.account(ledger.read_ledgers(records), num_groups, events)
    groups, lines = [], []
    for group in range(num_groups):
        mine = [e for e in events if e.get("group") == group]
        pids = sorted({e["pid"] for e in mine if e["event"] == "start"})
        heals = [e for e in mine if e["event"] == "heal"]
        groups.append({"group": group, "exit_code": codes[group], "starts": len(pids), "pids": pids,
                       "heals": [{k: e[k] for k in ("time", "from_step", "to_step", "seconds")} for e in heals],
                       "committed_steps": acc.by_group.get(group, 0),
                       "steps_with_fewer_groups": acc.alone.get(group, 0)})
        heal_text = ", ".join(f"step {h['from_step']} -> {h['to_step']} in {h['seconds']:.2f} s" for h in heals)
        ended = [e for e in mine if e["event"] == "ended"]
        lines.append(f"group {group}: exit {codes[group]}, {max(len(pids) - 1, 0)} restart(s), "
                     f"{len(heals)} heal(s){' (' + heal_text + ')' if heals else ''}, "
                     f"{acc.by_group.get(group, 0)} steps committed ({acc.alone.get(group, 0)} with fewer groups)"
                     + "".join(f"; stopped at step {e['step']}: group(s) {e['finished_by']} had finished the run"
                               for e in ended))
    lines.append(ledger.describe(acc))
    lines.append("final weights: none written, no group finished" if weights_by is None else
                 f"final weights {FINAL_WEIGHTS} written by group {weights_by}"
                 + ("" if weights_by == 0 else f" ({GROUP_DIR.format(group=weights_by)}/{FINAL_WEIGHTS}; group 0 "
                                                "did not finish)"))
    return {"seconds": round(seconds, 2), "final_weights_group": weights_by, "groups": groups, "steps": acc.steps, "samples": acc.samples,
            "exact": acc.exact, "gaps": acc.gaps, "overlaps": acc.overlaps, "dropped": acc.dropped, "superseded": acc.superseded,
            "discarded": acc.discarded, "weights_compared": acc.weights_compared, "weights_differ": acc.weights_differ,
            "lines": lines}
