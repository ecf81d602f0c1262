"""Say which rank ended each failed attempt, at the moment the agent restarts the group.

torchelastic restarts all workers after a failure without a word at meshrun's log level, and
the final failure summary only covers the last attempt: a job that crashed once and then
succeeded would leave no trace. The agent logs one ERROR record per failed attempt
("failed (exitcode: X) local_rank: L (pid: P) ..."); `AttemptRecorder` listens for it, adds
what the ranks' error files of that attempt say, prints one line to stderr and appends it to
`<log_dir>/failures.log`, so the failure of attempt 0 stays on record even when attempt 1 works.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from meshrun.launch.failure import RankFailure, WorkerExit

FAILURES_FILE = "failures.log"


def _attempt_dirs(log_root: str, run_dir: str | None = None) -> list[str]:
    """This agent's attempt directories, oldest first.

    `run_dir` is the agent's own `<log_root>/<run_id>_XXXX` when known: a --log-dir shared by two
    nodes on one file system, or reused, holds other agents' runs too. Else the newest run.
    """
    runs = [d for d in glob.glob(os.path.join(log_root, "*")) if glob.glob(os.path.join(d, "attempt_*"))]
    if run_dir and os.path.isdir(run_dir):
        runs = [run_dir]
    if not runs:
        return []
    newest = max(runs, key=os.path.getmtime)
    found = glob.glob(os.path.join(newest, "attempt_*"))
    return sorted(found, key=lambda p: int(p.rsplit("attempt_", 1)[1]))


def attempt_failures(attempt_dir: str, exitcode: int, local_rank: int, pid: int) -> list[RankFailure]:
    """The agent's first failure plus every rank that left an error file, root cause first."""
    from meshrun.launch.failure import ERROR_FILE, RankFailure, classify_follow_on, read_error_file

    failures: dict[int, RankFailure] = {}
    for rank_dir in glob.glob(os.path.join(attempt_dir, "*")):
        name = os.path.basename(rank_dir)
        data = read_error_file(os.path.join(rank_dir, ERROR_FILE))
        if not name.isdigit() or not data:
            continue
        failure = RankFailure(rank=-1, local_rank=int(name), time=time.time())
        failure.read_error_data(data)
        failures[failure.local_rank] = failure
    first = failures.get(local_rank) or RankFailure(-1, local_rank, time=time.time())
    first.pid, first.exitcode = pid, exitcode  # the agent reports the exit status of this one only
    failures[local_rank] = first
    ordered = classify_follow_on(list(failures.values()))
    # The agent's pick is the earliest by its timestamps; a cause beats a consequence.
    return sorted(ordered, key=lambda f: (f.follow_on, f.local_rank != local_rank, f.time or 0.0))


def silent_ranks(attempt_dir: str, failures: list[RankFailure]) -> list[int]:
    """Local ranks of an attempt that left no error file and are not the agent's pick.

    The agent orders failures by whole seconds, so a SIGKILLed rank can lose to the peer that
    raised 'Connection reset' a moment later; the rank that said nothing is then the suspect.
    """
    known = {f.local_rank for f in failures}
    ranks = [os.path.basename(d) for d in glob.glob(os.path.join(attempt_dir, "*"))]
    return sorted(int(r) for r in ranks if r.isdigit() and int(r) not in known)


class AttemptRecorder(logging.Handler):
    """Catches the agent's per-attempt failure record; prints and files a one-line notice."""

    def __init__(self, log_root: str, max_restarts: int, stream=None, logs_specs=None,
                 exits: Mapping[int, WorkerExit] | None = None) -> None:
        super().__init__(level=logging.ERROR)
        self.log_root = log_root
        self.exits = exits  # the agent's record of each worker's end (torch_elastic.run_agent): who left early
        self.logs_specs = logs_specs  # torch's DefaultLogsSpecs: knows this agent's own run dir
        self.max_restarts = max_restarts
        self.failed_attempts = 0
        self.lines: list[str] = []
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        from meshrun.launch.failure import RankFailure, name_first_to_leave
        from meshrun.launch.torch_elastic import agent_failure_record, run_log_dir

        agent = agent_failure_record(record)
        if agent is None:
            return
        try:
            exitcode, local_rank, pid = agent
            dirs = _attempt_dirs(self.log_root, run_log_dir(self.logs_specs))
            attempt = int(dirs[-1].rsplit("attempt_", 1)[1]) if dirs else self.failed_attempts
            failures = attempt_failures(dirs[-1], exitcode, local_rank, pid) if dirs else [
                RankFailure(-1, local_rank, pid, exitcode, time.time())]
            failures = name_first_to_leave(failures, self.exits or {})
            self.failed_attempts += 1
            left = self.max_restarts - self.failed_attempts + 1
            then = (f"restarting (restart {self.failed_attempts} of --max-restarts {self.max_restarts})"
                    if left > 0 else "no restarts left")
            cause = failures[0].describe()
            if failures[0].follow_on:  # nothing that raised here failed on its own
                silent = silent_ranks(dirs[-1], failures) if dirs else []
                cause = (f"local rank {', '.join(map(str, silent))} ended without a Python error "
                         f"(a signal such as SIGKILL, or the OOM killer?)" if silent else
                         f"{cause} (a consequence: another rank or node failed first, or a node left)")
            line = f"meshrun: attempt {attempt} failed on {socket.gethostname()}: {cause}; {then}"
            self.lines.append(line)
            try:
                os.makedirs(self.log_root, exist_ok=True)
                with open(os.path.join(self.log_root, FAILURES_FILE), "a") as fp:
                    fp.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
                    for other in failures[1:]:
                        fp.write(f"    then {other.describe()}\n")
            except OSError:  # a full disk: the notice below and the summary still say it
                pass
            if left > 0:  # otherwise the job's failure summary follows at once
                stream = self.stream or sys.stderr
                stream.write(line + "\n")
                stream.flush()
        except Exception:  # noqa: BLE001 - a notice must never take the agent down
            self.handleError(record)


def install(log_root: str, max_restarts: int, logs_specs=None,
            exits: Mapping[int, WorkerExit] | None = None) -> AttemptRecorder:
    """Listen to the agent's failure records until uninstall()."""
    from meshrun.launch.torch_elastic import AGENT_PROCS_LOGGER

    recorder = AttemptRecorder(log_root, max_restarts, logs_specs=logs_specs, exits=exits)
    logging.getLogger(AGENT_PROCS_LOGGER).addHandler(recorder)
    return recorder


def uninstall(recorder: AttemptRecorder) -> None:
    from meshrun.launch.torch_elastic import AGENT_PROCS_LOGGER

    logging.getLogger(AGENT_PROCS_LOGGER).removeHandler(recorder)
