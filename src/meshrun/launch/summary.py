"""Turn torchelastic's ChildFailedError into a summary that leads with the rank that failed first.

Other ranks usually fail a moment later with a consequence (connection reset by the dead peer,
store timeouts); those are listed below the root cause, never as the headline. Each rank's
failure is a `RankFailure` (failure.py), told by its own formatter.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time

from meshrun.launch.failure import (
    FOLLOW_ON_PATTERNS,
    RankFailure,
    classify_follow_on,
    is_follow_on,
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


def collect_failures(child_failed_error, log_root: str | None, *, verbose: bool | None = None) -> list[RankFailure]:
    """RankFailures for every rank in a torchelastic ChildFailedError, root cause first.

    `verbose` keeps C++ stack lines and meshrun's frames in the log tails (RankFailure.read_logs).
    """
    host = socket.gethostname()
    failures = []
    for rank, pf in child_failed_error.failures.items():
        failure = RankFailure(rank, pf.local_rank, pf.pid, pf.exitcode, float(pf.timestamp), host=host)
        error_file = getattr(pf, "error_file", None)
        failure.read_error_data(read_error_file(error_file))
        # torchelastic writes error.json next to the rank's stdout/stderr logs: that directory is
        # exact even when nodes share a --log-dir; the newest attempt is a fallback.
        own_dir = os.path.dirname(error_file) if error_file else None
        log_dir = own_dir if own_dir and os.path.isdir(own_dir) else rank_log_dir(log_root, pf.local_rank)
        if log_dir:
            failure.read_logs(log_dir, verbose=verbose)
        failures.append(failure)
    failures = classify_follow_on(failures)
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
    lines = ["", "=" * 72, f"meshrun: job failed. Rank {root.rank} failed first ({where}): {root.status}"]
    if root.exc_type:
        lines.append(f"  {root.exc_type}: {root.exc_text}")
    if root.site:
        lines.append(f"  at {root.site}")
    if root.hint:
        lines.append(f"  fix: {root.hint}")
    for stream, tail in (("stdout", root.stdout_tail), ("stderr", root.tail)):
        if tail:
            lines.append(f"  last lines of rank {root.rank}'s {stream}:")
            lines.extend(f"    | {line}" for line in tail)
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
