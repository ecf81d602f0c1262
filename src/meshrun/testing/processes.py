"""Process trees by pid: a process's descendants, `meshrun launch`'s workers among them, and
kill_tree, which stops a whole tree (never by name). For tests and benchmarks that start jobs.
Linux /proc; standard library only (meshrun.launch.leftovers is too).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from meshrun.launch.leftovers import processes_in, running


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fp:
                    ppid = int(fp.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def worker_pids(pid: int) -> list[int]:
    """The launch workers under `pid`: worker_main.py processes, or `meshrun train`'s forked ones
    (named meshrun-worker, launch/preload.py; their cmdline is their forkserver's)."""
    found = []
    for child in descendants(pid):
        try:
            comm = Path(f"/proc/{child}/comm").read_text().strip()
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if comm == "meshrun-worker" or "worker_main.py" in cmdline:
            found.append(child)
    return found


def describe_tree(pid: int, stacks_s: float = 2.0) -> str:
    """For a job that did not end in time: each process under `pid` (pid, state, kernel wait
    channel, command), after asking its launch workers for their Python stacks (SIGUSR2: the
    workers' faulthandler, on while the hang watchdog is, i.e. by default; the stacks go to the
    job's log). Call it before kill_tree."""
    workers = worker_pids(pid)
    for worker in workers:
        try:
            os.kill(worker, signal.SIGUSR2)
        except OSError:
            pass
    if workers:
        time.sleep(stacks_s)
    lines = []
    for proc in [pid, *descendants(pid)]:
        try:
            state = Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{proc}/wchan").read_text().strip() or "-"
        except OSError:
            continue
        command = _cmdline(proc).replace(b"\0", b" ").decode(errors="replace").strip()[:160]
        lines.append(f"  {proc} {state} {wchan:<24} {'(worker) ' if proc in workers else ''}{command}")
    return "process tree (pid, state, wait channel, command):\n" + "\n".join(lines)


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` still running. A job started with start_new_session is one group."""
    return processes_in(group=pgid)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill_tree(pid: int, tracker_grace: float = 5.0) -> None:
    """SIGKILL a process and every descendant, by pid (workers run in sessions of their own).

    multiprocessing's resource trackers among them go last: once everything else is dead their pipe
    closes, and they unlink the named semaphores (/dev/shm/sem.mp-*) of torch's launcher queues and
    exit. SIGKILLed with the rest they left those files behind (~480 a suite). Bounded: a tracker
    still running after `tracker_grace` seconds is SIGKILLed too.
    """
    targets = [pid, *descendants(pid)]
    trackers = [t for t in targets if b"multiprocessing.resource_tracker" in _cmdline(t)]
    for target in targets:
        if target not in trackers:
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + tracker_grace
    for tracker in trackers:
        while running(tracker) and time.monotonic() < deadline:
            time.sleep(0.02)
        if running(tracker):
            try:
                os.kill(tracker, signal.SIGKILL)
            except ProcessLookupError:
                pass
