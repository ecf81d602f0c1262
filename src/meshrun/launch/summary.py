"""Turn torchelastic's ChildFailedError into a summary that leads with the rank that failed first.

Other ranks usually fail a moment later with a consequence (connection reset by the dead peer,
store timeouts); those are listed below the root cause, never as the headline. A rank that left
while its peers still ran (exit code 0, which torch's record leaves out) is named from the
agent's exit records. Each rank's failure is a `RankFailure` (failure.py), told by its own formatter.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
from collections.abc import Mapping

from meshrun.launch.failure import (
    FOLLOW_ON_PATTERNS,
    LEFT_EARLY_FIX,
    RankFailure,
    WorkerExit,
    classify_follow_on,
    is_follow_on,
    name_first_to_leave,
    order_by_cause,
    read_error_file,
)

__all__ = ["FAILURES_FILE", "FOLLOW_ON_PATTERNS", "LAUNCH_ERROR_FILE", "RankFailure", "collect_failures",
           "format_summary", "is_follow_on", "order_by_cause", "rank_log_dir", "record_launch_error",
           "save_failures"]

FAILURES_FILE = "failures.json"
LAUNCH_ERROR_FILE = "launch_error.json"


def rank_log_dir(root: str | None, local_rank: int) -> str | None:
    """The newest attempt's directory for `local_rank` under a launch's --log-dir."""
    if not root:
        return None
    found = glob.glob(os.path.join(root, "*", "attempt_*", str(local_rank)))
    # a reused --log-dir holds several runs: the newest attempt of the newest run
    found.sort(key=lambda p: (os.path.getmtime(os.path.dirname(os.path.dirname(p))),
                              int(p.split("attempt_")[-1].split(os.sep)[0])))
    return found[-1] if found else None


def collect_failures(child_failed_error, log_root: str | None, *, verbose: bool | None = None,
                     exits: Mapping[int, WorkerExit] | None = None) -> list[RankFailure]:
    """RankFailures for every rank in a torchelastic ChildFailedError, root cause first.

    `verbose` keeps C++ stack lines and meshrun's frames in the log tails (RankFailure.read_logs).
    `exits`: the agent's record of each local rank's end (launch/torch_elastic.py), which names a
    rank that left with exit code 0 while its peers still ran (failure.name_first_to_leave).
    """
    host = socket.gethostname()
    exits = exits or {}
    failures = []
    attempt_dir = None
    for rank, pf in child_failed_error.failures.items():
        agent_time = float(pf.timestamp)  # whole seconds
        failure = RankFailure(rank, pf.local_rank, pf.pid, pf.exitcode, agent_time, host=host)
        error_file = getattr(pf, "error_file", None)
        failure.read_error_data(read_error_file(error_file))
        if failure.time == agent_time and pf.local_rank in exits:  # no error file's time: the agent's own, exact
            failure.time = exits[pf.local_rank].time
        # torchelastic writes error.json next to the rank's stdout/stderr logs: that directory is
        # exact even when nodes share a --log-dir; the newest attempt is a fallback.
        own_dir = os.path.dirname(error_file) if error_file else None
        log_dir = own_dir if own_dir and os.path.isdir(own_dir) else rank_log_dir(log_root, pf.local_rank)
        if log_dir:
            failure.read_logs(log_dir, verbose=verbose)
            attempt_dir = os.path.dirname(log_dir)
        failures.append(failure)
    failures = name_first_to_leave(classify_follow_on(failures), exits, host=host)
    for failure in failures:
        if failure.log_dir is None:  # a rank that left: no failure record of torch's names its logs
            sibling = os.path.join(attempt_dir, str(failure.local_rank)) if attempt_dir else None
            log_dir = sibling if sibling and os.path.isdir(sibling) else rank_log_dir(log_root, failure.local_rank)
            if log_dir:
                failure.read_logs(log_dir, verbose=verbose)
    save_failures(failures, log_root)
    return failures


def record_launch_error(log_root: str | None, message: str, stage: str) -> None:
    """A failure before any worker ran (preflight, rendezvous): kept for `meshrun diagnose`."""
    if not log_root:
        return
    try:
        os.makedirs(log_root, exist_ok=True)
        with open(os.path.join(log_root, LAUNCH_ERROR_FILE), "w") as fp:
            json.dump({"time": time.time(), "host": socket.gethostname(), "stage": stage,
                       "message": message}, fp, indent=1)
    except OSError:
        pass


def save_failures(failures: list[RankFailure], log_root: str | None) -> None:
    """What the agent knows and the rank logs do not (exit codes, signals), for `meshrun diagnose`."""
    if not log_root or not os.path.isdir(log_root):
        return
    rows = [{**f.to_json(), "host": f.host or socket.gethostname()} for f in failures]
    try:
        with open(os.path.join(log_root, FAILURES_FILE), "w") as fp:
            json.dump({"failures": rows}, fp, indent=1)
    except OSError:
        pass


def format_summary(failures: list[RankFailure], log_root: str | None, attempts: int = 1) -> str:
    """The human summary printed at the end of a failed launch."""
    root = failures[0]
    where = f"local rank {root.local_rank} on {root.host or socket.gethostname()}, pid {root.pid}"
    others = sorted(f.rank for f in failures[1:] if f.rank >= 0)
    if root.left_early:
        still = (f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others
                 else "the other ranks")
        head = f"Rank {root.rank} left first ({where}): it exited with code 0{_clock(root.time)} while {still} still ran"
    else:
        head = f"Rank {root.rank} failed first ({where}): {root.status}"
    lines = ["", "=" * 72, f"meshrun: job failed. {head}"]
    if root.exc_type:
        lines.append(f"  {root.exc_type}: {root.exc_text}")
    if root.site:
        lines.append(f"  at {root.site}")
    if root.left_early:
        lines.append(f"  fix: {LEFT_EARLY_FIX}")
    elif not root.exc_type and not root.follow_on and len(failures) > 1 and failures[1].follow_on:
        lines.append(f"  no Python error was recorded: the process ended{_clock(root.time)} without one (os._exit "
                     "or sys.exit with a code, a crash in native code, or a kill such as the OOM killer's) while "
                     "the other ranks still ran; their failures below followed from it")
    if root.hint:
        lines.append(f"  fix: {root.hint}")
    for stream, tail in (("stdout", root.stdout_tail), ("stderr", root.tail)):
        if tail:
            lines.append(f"  last lines of rank {root.rank}'s {stream}:")
            lines.extend(f"    | {line}" for line in tail)
    if root.follow_on:  # every failure here is a consequence: the cause is not among this node's ranks
        lines.append("  every failure here followed from another's: the cause is a rank that ended without an "
                     "error, or one on another node (see that node's output)")
    if len(failures) > 1:
        lines.append("  then, as a consequence:" if failures[1].follow_on else "  other failed ranks:")
        for other in failures[1:]:
            lines.append(f"    rank {other.rank}: {other.describe(who=False)}")
    if root.log_dir:
        lines.append(f"  rank {root.rank}'s full output: {root.log_dir}/stderr.log and stdout.log")
    if log_root:
        lines.append(f"  every rank's logs: {log_root} (<run>/attempt_N/<local_rank>/)")
    if attempts > 1:
        lines.append(f"  the job was attempted {attempts} times (--max-restarts {attempts - 1})")
    lines.append("=" * 72)
    return "\n".join(lines)


def _clock(when: float | None) -> str:
    """' at 12:00:01.25' (local time), or '' when unknown."""
    if not when:
        return ""
    return f" at {time.strftime('%H:%M:%S', time.localtime(when))}.{int(when % 1 * 100):02d}"
