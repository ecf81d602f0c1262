"""One rank's failure, whatever recorded it, and the one way it is told.

A rank's failure is known from up to four places: the agent's exit status (an exit code, or a
signal), the rank's error file (`error.json`: meshrun's worker bootstrap or torchelastic's
`@record`, which covers the hang watchdog's and the collective checker's reports, raised as
exceptions), and its stderr/stdout logs. `RankFailure` gathers them; `status` and `describe()`
are the only formatters. The launcher's summary (summary.py), its per-attempt notices
(attempts.py) and `meshrun diagnose` (diagnose/postmortem.py) all use this type.

A rank that raised is reported as having raised, even when the agent then stopped it with
SIGTERM while it was still exiting: the signal is the agent's reaction to a peer, not the cause.

A rank that left while its peers still ran (exit code 0 is no failure to the agent, so torch's
record leaves it out) is known from the agent's `WorkerExit` records (launch/torch_elastic.py):
`name_first_to_leave` puts it in front of the connection errors its peers then met.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from meshrun.debug.readable import strip_cpp

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
# What the agent sends the surviving workers when it stops a group.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
# Exceptions that mean "stopped", not "failed on its own".
_NOT_RAISED = ("KeyboardInterrupt", "SystemExit")
_TB_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Detected)): (.*)$")
# meshrun's own refusal on a worker (cli/__init__.py prints a MeshrunError so, and exits 2)
_MESHRUN_LINE = re.compile(r"^meshrun(?: [\w-]+)?: error: (.+)$")
# A rank that waited for a peer that had left also times out (gloo: "Timed out waiting 10000ms for recv";
# NCCL: "Watchdog caught collective operation timeout"). Not the hang watchdog's own report (is_follow_on).
_WAITED = re.compile(r"[Tt]imed out|Socket Timeout|operation timeout")
ERROR_FILE = "error.json"
LEFT_EARLY_FIX = ("a rank left the training loop early (os._exit, sys.exit, a return on one rank only, or an "
                  "uneven number of batches): every rank must make the same collective calls, then end together")
TAIL_LINES = 12
STDOUT_TAIL_LINES = 5


@dataclass
class WorkerExit:
    """One worker process's end, as the agent saw it: what torch's failure record leaves out."""

    local_rank: int
    rank: int  # global rank; -1 when unknown
    pid: int
    exitcode: int  # negative: killed by that signal
    time: float  # when the agent saw the process gone (within its monitor interval, 0.1 s by default)
    running: bool  # the group was still running then; False: it ended after the agent began stopping the group


@dataclass
class RankFailure:
    """One failed worker, as far as its exit status, error file and logs tell."""

    rank: int  # global rank; -1 when only the local rank is known
    local_rank: int
    pid: int = 0  # 0: unknown
    exitcode: int | None = None  # negative: killed by that signal; None: unknown (no agent record)
    time: float | None = None  # when it failed (error file), else the agent's or the logs' time
    exc_type: str | None = None
    exc_text: str | None = None
    site: str | None = None  # "path/to/file.py:LINE in function"
    tail: list[str] | None = None  # last lines of stderr
    stdout_tail: list[str] | None = None
    log_dir: str | None = None
    host: str | None = None
    follow_on: bool = False  # failed because a peer went away (set by classify_follow_on)
    hint: str | None = None  # meshrun's explanation of a known torch error (debug/explain.py)

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def left_early(self) -> bool:
        """The rank ended with exit code 0 while its peers still ran (see name_first_to_leave)."""
        return self.exitcode == 0 and not self.raised

    @property
    def raised(self) -> bool:
        """The rank recorded an exception of its own (not an interrupt or a plain exit)."""
        return bool(self.exc_type) and self.exc_type not in _NOT_RAISED

    @property
    def exception(self) -> str | None:
        """'Type: text' on one line, clipped, or None."""
        if not self.exc_type:
            return None
        return clip(f"{self.exc_type}: {self.exc_text or ''}".rstrip(": "), 160)

    @property
    def status(self) -> str:
        """How the rank ended, in a few words: 'raised ValueError, exit code 1', 'killed by SIGKILL'."""
        sig = self.signal_name
        if self.raised:
            return f"raised {self.exc_type}" + self._after_raising()
        if sig:
            return f"killed by {sig}"
        if self.left_early:
            return "exit code 0 while the other ranks still ran"
        return "failed" if self.exitcode is None else f"exit code {self.exitcode}"

    def _after_raising(self) -> str:
        sig = self.signal_name
        if sig in STOP_SIGNALS:
            return f", then stopped by {sig} from the agent while exiting"
        if sig:
            return f", then killed by {sig}"
        return "" if self.exitcode is None else f", exit code {self.exitcode}"

    @property
    def shell_exit_code(self) -> int:
        """What a shell would report: the code itself, or 128 + signal number.

        A rank that raised and was then stopped by the agent would have exited with 1.
        """
        if self.exitcode is None or (self.raised and self.signal_name in STOP_SIGNALS):
            return 1
        return 128 - self.exitcode if self.exitcode < 0 else max(self.exitcode, 1)

    @property
    def who(self) -> str:
        """'rank 1 (local rank 1, pid 42)', or 'local rank 1 (pid 42)' when the rank is unknown."""
        details = [f"local rank {self.local_rank}"] if self.rank >= 0 else []
        if self.host:
            details.append(f"on {self.host}")
        if self.pid:
            details.append(f"pid {self.pid}")
        name = f"rank {self.rank}" if self.rank >= 0 else f"local rank {self.local_rank}"
        return f"{name} ({', '.join(details)})" if details else name

    def describe(self, *, who: bool = True) -> str:
        """One line: 'rank 1 (local rank 1, pid 42): ValueError: bad batch at t.py:9 in main'."""
        if self.raised:
            line = self.exception or ""
            if self.site:
                line += f" at {self.site}"
            line += self._after_raising() if self.exitcode != 1 else ""
        else:
            line = self.status
            if self.exception:
                line += f"; {self.exception}"
            if self.site:
                line += f" at {self.site}"
        return f"{self.who}: {line}" if who else line

    def to_json(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "pid": self.pid, "exitcode": self.exitcode,
                "signal": self.signal_name, "time": self.time, "host": self.host, "log_dir": self.log_dir,
                "follow_on": self.follow_on, "exc_type": self.exc_type, "exc_text": self.exc_text,
                "site": self.site}

    # --- reading what the rank left -------------------------------------------------------------

    def read_error_data(self, data: dict) -> None:
        """Fill the exception, call site, time and rank from an error file's contents."""
        extra = data.get("meshrun") if isinstance(data, dict) else None
        message = data.get("message") if isinstance(data, dict) else None
        if isinstance(extra, dict):
            if extra.get("time"):
                self.time = float(extra["time"])
            self.exc_type, self.exc_text = extra.get("type"), extra.get("text")
            self.site = f"{extra.get('file')}:{extra.get('line')} in {extra.get('function')}"
            self.hint = extra.get("hint")
            if self.rank < 0 and str(extra.get("rank", "")).isdigit():
                self.rank = int(extra["rank"])
            if not self.pid and isinstance(extra.get("pid"), int) and extra["pid"] > 0:
                self.pid = extra["pid"]
        elif isinstance(message, dict):  # torchelastic @record format: "Type: text" + py_callstack
            self.exc_type, _, self.exc_text = str(message.get("message", "")).partition(": ")
            self.exc_text = strip_cpp(self.exc_text)
            stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
            sites = _TB_LINE.findall(stack)
            if sites:
                path, line, func = sites[-1]
                self.site = f"{path}:{line} in {func}"

    def read_logs(self, log_dir: str, *, verbose: bool | None = None) -> None:
        """The last lines of the rank's stderr/stdout; the exception from stderr when no file said.

        Unless `verbose` (default: MESHRUN_VERBOSE), C++ stack lines and meshrun's own frames are
        left out of the lines kept (debug/readable.py).
        """
        self.log_dir = log_dir
        self.tail = tail(os.path.join(log_dir, "stderr.log"), verbose=verbose)
        self.stdout_tail = tail(os.path.join(log_dir, "stdout.log"), STDOUT_TAIL_LINES, verbose=verbose)
        if self.exc_type is None:
            self.read_exception_from_log(self.tail)

    def read_exception_from_log(self, lines: list[str]) -> None:
        """For scripts run without the bootstrap (--no-python): the last 'Type: text' line."""
        sites = _TB_LINE.findall("\n".join(lines))
        if sites and self.site is None:
            path, line, func = sites[-1]
            self.site = f"{path}:{line} in {func}"
        for line in reversed(lines):
            match = _EXC_LINE.match(line.strip())
            if match:
                self.exc_type, self.exc_text = match.group(1), match.group(2)
                return
            match = _MESHRUN_LINE.match(line.strip())
            if match:
                self.exc_type, self.exc_text = "MeshrunError", match.group(1)
                return


def read_error_file(path: str | None) -> dict:
    """An error file's JSON, or {} when it is missing or damaged (a damaged file is no failure)."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as fp:
            data = json.load(fp)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tail(path: str, n: int = TAIL_LINES, *, verbose: bool | None = None) -> list[str]:
    """The last n non-blank lines of a log file ([] when unreadable); see RankFailure.read_logs."""
    from meshrun.debug.readable import readable_lines
    from meshrun.debug.readable import verbose as verbose_env

    try:
        with open(path, errors="replace") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return []
    if not (verbose_env() if verbose is None else verbose):
        lines = readable_lines(lines)
    return [line for line in lines if line.strip()][-n:]


def is_follow_on(failure: RankFailure) -> bool:
    """True when the rank failed because a peer went away, not on its own."""
    text = " ".join(filter(None, [failure.exc_type, failure.exc_text]))
    if failure.exc_type == "HangDetected":  # the watchdog's abort: a consequence on a rank that waited
        return any(pattern in text for pattern in WATCHDOG_WAITING)
    if any(pattern in text for pattern in FOLLOW_ON_PATTERNS):
        return True
    if failure.signal_name in STOP_SIGNALS:
        # The agent stops the survivors with these. A rank that recorded an exception of its
        # own before the agent's signal reached it (it was still exiting) failed on its own.
        return not failure.raised
    return False


def classify_follow_on(failures: list[RankFailure]) -> list[RankFailure]:
    """Set each failure's follow_on; return them root causes first (see order_by_cause)."""
    for failure in failures:
        failure.follow_on = is_follow_on(failure)
    return order_by_cause(failures)


def order_by_cause(failures: list[RankFailure]) -> list[RankFailure]:
    """Root causes before consequences; within each, earliest first (rank breaks ties)."""
    return sorted(failures, key=lambda f: (f.follow_on, f.time or 0.0, f.rank))


def name_first_to_leave(failures: list[RankFailure], exits: Mapping[int, WorkerExit],
                        host: str | None = None) -> list[RankFailure]:
    """`failures` (root cause first) led by the ranks that left while their peers still ran.

    The agent counts a rank that exits with code 0 as done, not failed: its peers then meet a
    closed connection (or a timeout) in their next collective, and only they are failures. Such
    a rank, seen gone (`exits`, by local rank) before every failure here, is the cause, unless
    a rank raised an exception of its own (not a peer's connection error, not a timeout): that
    exception stays the cause. Waiting ranks' timeouts become consequences of the rank that left.
    Within one poll of the agent a failure that is not a consequence keeps the lead.
    """
    if not failures or not exits:
        return failures
    failed = {f.local_rank for f in failures}
    ended = {f.local_rank: exits[f.local_rank].time for f in failures if f.local_rank in exits}

    def before_every_failure(e: WorkerExit) -> bool:
        return all(e.time <= t if f.follow_on else e.time < t
                   for f in failures for t in [ended.get(f.local_rank, float("inf"))])

    left = sorted((e for e in exits.values() if e.exitcode == 0 and e.running and e.local_rank not in failed
                   and before_every_failure(e)), key=lambda e: (e.time, e.local_rank))
    root = failures[0]
    if not left or (root.raised and not root.follow_on and not _timed_out(root)):
        return failures
    for failure in failures:
        failure.follow_on = failure.follow_on or _timed_out(failure)
    leavers = [RankFailure(e.rank, e.local_rank, e.pid, 0, e.time, host=host) for e in left]
    return leavers + order_by_cause(failures)


def _timed_out(failure: RankFailure) -> bool:
    """The rank raised a timeout waiting for a peer (see _WAITED)."""
    return failure.raised and failure.exc_type != "HangDetected" and bool(_WAITED.search(failure.exception or ""))


def clip(text: str, width: int = 140) -> str:
    """One line, at most `width` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."
