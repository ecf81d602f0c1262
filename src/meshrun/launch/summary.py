"""Turn torchelastic's ChildFailedError into a summary that leads with the rank that failed first.

Other ranks usually fail a moment later with a consequence (connection reset by the dead peer,
store timeouts); those are listed below the root cause, never as the headline.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import time
from dataclasses import dataclass

# Messages that ranks print when a *peer* died: consequences, not causes.
FOLLOW_ON_PATTERNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "DistNetworkError",
    "DistStoreError",
    "RendezvousConnectionError",
    "RendezvousClosedError",
    "Socket Timeout",
    "communicator was aborted",
    "NCCL communicator",
    "Read error",
    "recvBytes",
    "sendBytes",
)
# The hang watchdog's report on a rank that was waiting for a peer (meshrun.debug.watchdog).
WATCHDOG_WAITING = (" is waiting in ", " is waiting inside torch")
_TB_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
TAIL_LINES = 12
STDOUT_TAIL_LINES = 5


@dataclass
class RankFailure:
    """One failed worker, as far as its exit status, error file and logs tell."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    time: float
    exc_type: str | None = None
    exc_text: str | None = None
    site: str | None = None  # "path/to/file.py:LINE in function"
    tail: list[str] | None = None  # last lines of stderr
    stdout_tail: list[str] | None = None
    log_dir: str | None = None
    follow_on: bool = False
    hint: str | None = None  # meshrun's explanation of a known torch error (debug/explain.py)

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def status(self) -> str:
        sig = self.signal_name
        return f"killed by {sig}" if sig else f"exit code {self.exitcode}"

    @property
    def shell_exit_code(self) -> int:
        """What a shell would report: the code itself, or 128 + signal number."""
        return 128 - self.exitcode if self.exitcode < 0 else max(self.exitcode, 1)


def _read_error_file(path: str | None) -> dict:
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as fp:
            return json.load(fp)
    except (OSError, ValueError):
        return {}


def _tail(path: str, n: int = TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


def rank_log_dir(root: str | None, local_rank: int) -> str | None:
    """The newest attempt's directory for `local_rank` under a launch's --log-dir."""
    if not root:
        return None
    found = glob.glob(os.path.join(root, "*", "attempt_*", str(local_rank)))
    # a reused --log-dir holds several runs: the newest attempt of the newest run
    found.sort(key=lambda p: (os.path.getmtime(os.path.dirname(os.path.dirname(p))),
                              int(p.split("attempt_")[-1].split(os.sep)[0])))
    return found[-1] if found else None


def _from_error_data(failure: RankFailure, data: dict) -> None:
    extra = data.get("meshrun")
    message = data.get("message")
    if isinstance(extra, dict):
        failure.time = float(extra.get("time", failure.time))
        failure.exc_type = extra.get("type")
        failure.exc_text = extra.get("text")
        failure.site = f"{extra.get('file')}:{extra.get('line')} in {extra.get('function')}"
        failure.hint = extra.get("hint")
        return
    if isinstance(message, dict):  # torchelastic @record format: "Type: text" + py_callstack
        head = str(message.get("message", ""))
        failure.exc_type, _, failure.exc_text = head.partition(": ")
        stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
        sites = _TB_LINE.findall(stack)
        if sites:
            path, line, func = sites[-1]
            failure.site = f"{path}:{line} in {func}"


def _exception_from_log(failure: RankFailure, lines: list[str]) -> None:
    """For scripts run without the bootstrap (--no-python): the last 'Type: text' line."""
    sites = _TB_LINE.findall("\n".join(lines))
    if sites and failure.site is None:
        path, line, func = sites[-1]
        failure.site = f"{path}:{line} in {func}"
    for line in reversed(lines):
        match = re.match(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): (.*)$", line.strip())
        if match:
            failure.exc_type, failure.exc_text = match.group(1), match.group(2)
            return


def collect_failures(child_failed_error, log_root: str | None) -> list[RankFailure]:
    """RankFailures for every rank in a torchelastic ChildFailedError, root cause first."""
    failures = []
    for rank, pf in child_failed_error.failures.items():
        failure = RankFailure(rank, pf.local_rank, pf.pid, pf.exitcode, float(pf.timestamp))
        _from_error_data(failure, _read_error_file(getattr(pf, "error_file", None)))
        # torchelastic writes error.json next to the rank's stdout/stderr logs: that directory is
        # exact even when nodes share a --log-dir; the newest attempt is a fallback.
        error_file = getattr(pf, "error_file", None)
        own_dir = os.path.dirname(error_file) if error_file else None
        failure.log_dir = own_dir if own_dir and os.path.isdir(own_dir) else rank_log_dir(log_root, pf.local_rank)
        if failure.log_dir:
            failure.tail = _tail(os.path.join(failure.log_dir, "stderr.log"))
            failure.stdout_tail = _tail(os.path.join(failure.log_dir, "stdout.log"), STDOUT_TAIL_LINES)
            if failure.exc_type is None:
                _exception_from_log(failure, failure.tail)
        failure.follow_on = is_follow_on(failure)
        failures.append(failure)
    failures = order_by_cause(failures)
    save_failures(failures, log_root)
    return failures


FAILURES_FILE = "failures.json"
LAUNCH_ERROR_FILE = "launch_error.json"


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
    rows = [{"rank": f.rank, "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
             "signal": f.signal_name, "time": f.time, "host": socket.gethostname(),
             "log_dir": f.log_dir, "follow_on": f.follow_on} for f in failures]
    try:
        with open(os.path.join(log_root, FAILURES_FILE), "w") as fp:
            json.dump({"failures": rows}, fp, indent=1)
    except OSError:
        pass


def is_follow_on(failure: RankFailure) -> bool:
    """True when the rank failed because a peer went away, not on its own."""
    text = " ".join(filter(None, [failure.exc_type, failure.exc_text]))
    if failure.exc_type == "HangDetected":  # the watchdog's abort: a consequence on a rank that waited
        return any(pattern in text for pattern in WATCHDOG_WAITING)
    if any(pattern in text for pattern in FOLLOW_ON_PATTERNS):
        return True
    if failure.signal_name in ("SIGTERM", "SIGINT", "SIGHUP"):
        # The agent stops the survivors with these. A rank that recorded an exception of its
        # own before the agent's signal reached it (it was still exiting) failed on its own.
        return failure.exc_type in (None, "KeyboardInterrupt", "SystemExit")
    return False


def order_by_cause(failures: list[RankFailure]) -> list[RankFailure]:
    """Root causes before consequences; within each, earliest first (rank breaks ties)."""
    return sorted(failures, key=lambda f: (f.follow_on, f.time, f.rank))


def format_summary(failures: list[RankFailure], log_root: str | None, attempts: int = 1) -> str:
    """The human summary printed at the end of a failed launch."""
    root = failures[0]
    host = socket.gethostname()
    lines = [
        "",
        "=" * 72,
        f"meshrun: job failed. Rank {root.rank} failed first (local rank {root.local_rank} on "
        f"{host}, pid {root.pid}): {root.status}",
    ]
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
            what = f"; {_clip(f'{other.exc_type}: {other.exc_text}')}" if other.exc_type else ""
            lines.append(f"    rank {other.rank}: {other.status}{what}")
    if root.log_dir:
        lines.append(f"  rank {root.rank}'s full output: {root.log_dir}/stderr.log and stdout.log")
    if log_root:
        lines.append(f"  every rank's logs: {log_root} (<run>/attempt_N/<local_rank>/)")
    if attempts > 1:
        lines.append(f"  the job was attempted {attempts} times (--max-restarts {attempts - 1})")
    lines.append("=" * 72)
    return "\n".join(lines)


def _clip(text: str, width: int = 140) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
