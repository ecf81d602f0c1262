"""One owner per run directory: an exclusive lock held by the `meshrun train` launcher for the whole run.

    with RunLock.acquire(run_dir):     # RunDirBusy (exit 2) when a live run holds it
        run_plan(plan)                 # workers and their restarts run under it; they never lock

The lock is `fcntl.flock` on RUN/.meshrun-lock. The kernel drops it when the holder exits, however
it exits (a SIGKILL too), so a dead holder never blocks a new run: the file it leaves names it, and
the next run takes over with a one-line note. Inside: the holder's pid, host and start time, for
the message that refuses a second run. The file itself stays (unlinking a lock file races with a
run that has just opened it); a clean release empties it. Python opens files non-inheritable, so
the workers the agent starts do not share the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from meshrun.errors import MeshrunError

LOCK_FILE = ".meshrun-lock"


class RunDirBusy(MeshrunError):
    """Another live run holds the run directory."""


def _describe(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {when}"


def read_holder(run_dir: Path) -> dict:
    """What the lock file says about its (last) holder; {} when empty, missing or unreadable."""
    try:
        text = (Path(run_dir) / LOCK_FILE).read_text(encoding="utf-8", errors="replace")[:4096]
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """The held lock of one run directory; `release()` (or leaving the `with`) gives it up."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = run_dir, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Take the lock of `run_dir` (which must exist) or raise RunDirBusy naming the holder."""
        path = Path(run_dir) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunDirBusy(f"run directory {run_dir}: cannot open its lock file {path} ({exc.strerror}); "
                             "check its permissions, or pick another train.run_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirBusy(f"run directory {run_dir}: cannot lock {path} ({exc.strerror})") from None
            raise RunDirBusy(f"run directory {run_dir} is in use by another meshrun train "
                             f"({_describe(read_holder(run_dir))}); wait for it to end, or give this run "
                             "another --set train.name=...") from None
        previous = read_holder(run_dir)
        if previous:  # a holder that never released: it died (a clean release empties the file)
            print(f"meshrun train: taking over the lock of {run_dir} from {_describe(previous)}, "
                  "which is no longer running", file=sys.stderr, flush=True)
        lock = cls(Path(run_dir), fd)
        lock._write({"pid": os.getpid(), "host": socket.gethostname(), "since": round(time.time(), 3)})
        return lock

    def _write(self, holder: dict) -> None:
        data = (json.dumps(holder) + "\n").encode() if holder else b""
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def release(self) -> None:
        """Empty the file (a clean end, not a death) and unlock. Safe to call twice."""
        if self._fd < 0:
            return
        try:
            self._write({})
        except OSError:  # a full disk must not keep the lock: closing the fd releases it anyway
            pass
        os.close(self._fd)  # closing the only descriptor drops the flock
        self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def create_unique(root: Path, name: str) -> Path:
    """A new directory root/name, or root/name-2, -3, ... when taken: created exclusively, never shared."""
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RunDirBusy(f"train.run_dir={str(root)!r}: 10000 runs named {name}-*; clean it up or set train.name")
