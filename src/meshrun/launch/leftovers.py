"""Processes a worker started that outlive it: found by session, stopped, named.

Every worker leads a session of its own: torch's agent starts exec'd workers with
`start_new_session`, and a forked one calls setsid first (preload.py). A process a rank starts
(`subprocess.Popen`, a fork, a shell pipeline) stays in that session unless it leaves it on
purpose, so once the worker is gone, what is left in its session is left over. torch stops only
the worker (a forked one), or signals its process group once (an exec'd one): a child that
ignores SIGTERM, or that was never signalled, outlived the job, on success and on failure.

`end_sessions` runs when the agent closes an attempt's workers (torch_elastic.py): SIGTERM to
what is left, LEFTOVER_GRACE_S to exit, then SIGKILL, and one line per process on stderr naming
it and the rank that started it. A process that called setsid itself is out of reach.
Linux /proc; elsewhere nothing is found.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping

LEFTOVER_GRACE_S = 2.0  # after SIGTERM, before SIGKILL: the workers' own --shutdown-timeout is spent by then


def processes_in(*, group: int | None = None, session: int | None = None) -> list[int]:
    """Running processes (zombies left out: an orphan's zombie may wait for a reaper that never
    comes) of process group `group` or session `session`, from /proc."""
    index, value = (2, group) if group is not None else (3, session)
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fp:
                fields = fp.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and fields[index] == str(value) and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            state = fp.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fp:
            line = fp.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return line if len(line) <= 120 else line[:117] + "..."


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_sessions(workers: Mapping[int, int], grace: float = LEFTOVER_GRACE_S) -> list[str]:
    """Stop what is left in each worker's session ({local rank: worker pid}); returns the lines printed."""
    me = os.getpid()
    left = {pid: rank for rank, leader in workers.items() for pid in processes_in(session=leader)
            if pid not in (me, leader)}
    if not left:
        return []
    commands = {pid: _command(pid) for pid in left}
    _signal_all(list(left), signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = list(left)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if running(pid)]
    _signal_all(alive, signal.SIGKILL)
    killed_by = {pid: "SIGKILL" if pid in alive else "SIGTERM" for pid in left}
    time.sleep(0.05 if alive else 0)
    lines = []
    for pid, rank in sorted(left.items(), key=lambda item: (item[1], item[0])):
        if running(pid):
            what = "could not be stopped (SIGKILL did not end it)"
        else:
            what = f"stopped it ({killed_by[pid]})"
        lines.append(f"meshrun: local rank {rank} left process {pid} running after it exited "
                     f"({commands[pid]}); {what}")
    sys.stdout.flush()
    for line in lines:
        print(line, file=sys.stderr)
    return lines

