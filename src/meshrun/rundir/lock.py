"""One owner per run directory: an exclusive lock held by the `meshrun train` launcher for the whole run.

    with RunLock.acquire(run_dir):     # RunDirBusy (exit 2) when a live run holds it
        run_spec(plan)                 # workers and their restarts run under it; they never lock

The lock is `fcntl.flock` on RUN/.meshrun-lock (shared by the launchers of one multi-node job). The kernel drops it when the holder exits, however
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


def _open(path: Path, run_dir: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunDirBusy(f"run directory {run_dir}: cannot open its lock file {path} ({exc.strerror}); "
                         "check its permissions, or pick another train.run_dir") from None


def _try(fd: int, how: int, path: Path) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise RunDirBusy(f"cannot lock {path} ({exc.strerror}); the filesystem must support flock") from None


def _busy(run_dir: Path) -> RunDirBusy:
    return RunDirBusy(f"run directory {run_dir} is in use by another meshrun train "
                      f"({_describe(read_holder(run_dir))}); wait for it to end, or give this run "
                      "another --set train.name=...")


class RunLock:
    """The held lock of one run directory; `release()` (or leaving the `with`) gives it up.

    A single-node run holds it exclusively. The launchers of one multi-node job (every node runs
    `meshrun train`, on a shared filesystem) hold it shared, under the job's key (rendezvous
    endpoint and id): a launcher of another job, or a single-node run, is refused.
    """

    def __init__(self, run_dir: Path, fd: int, job: str | None):
        self.run_dir, self._fd, self.job = run_dir, fd, job

    @classmethod
    def acquire(cls, run_dir: Path, job: str | None = None) -> RunLock:
        """Take the lock of `run_dir` (which must exist) or raise RunDirBusy naming the holder."""
        run_dir = Path(run_dir)
        path = run_dir / LOCK_FILE
        fd = _open(path, run_dir)
        if job is None:
            if not _try(fd, fcntl.LOCK_EX, path):
                os.close(fd)
                raise _busy(run_dir)
            return cls._took(run_dir, fd, None)
        # Shared: decide under a second, briefly held lock, so that two launchers never both "arrive first".
        gate = _open(run_dir / (LOCK_FILE + ".gate"), run_dir)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            probe = _open(path, run_dir)
            alone = _try(probe, fcntl.LOCK_EX, path)  # no launcher of any job holds it now
            os.close(probe)
            if not _try(fd, fcntl.LOCK_SH, path):  # a single-node run holds it
                os.close(fd)
                raise _busy(run_dir)
            if alone:
                return cls._took(run_dir, fd, job)
            if read_holder(run_dir).get("job") != job:  # the launchers of another multi-node job
                os.close(fd)
                raise _busy(run_dir)
            return cls(run_dir, fd, job)  # another node of this job: the file names the first
        finally:
            os.close(gate)

    @classmethod
    def _took(cls, run_dir: Path, fd: int, job: str | None) -> RunLock:
        previous = read_holder(run_dir)
        if previous:  # a holder that never released: it died (a clean release empties the file)
            print(f"meshrun train: taking over the lock of {run_dir} from {_describe(previous)}, "
                  "which is no longer running", file=sys.stderr, flush=True)
        lock = cls(run_dir, fd, job)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": round(time.time(), 3)}
        lock._write({**holder, "job": job} if job else holder)
        return lock

    def _write(self, holder: dict) -> None:
        data = (json.dumps(holder) + "\n").encode() if holder else b""
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def release(self) -> None:
        """Empty the file (a clean end, not a death; shared: by the last one out) and unlock. Idempotent."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        gate = None
        try:
            last = True
            if self.job is not None:  # under the gate: no launcher of this job joins meanwhile
                gate = _open(self.run_dir / (LOCK_FILE + ".gate"), self.run_dir)
                fcntl.flock(gate, fcntl.LOCK_EX)
                fcntl.flock(fd, fcntl.LOCK_UN)
                last = _try(fd, fcntl.LOCK_EX, self.run_dir / LOCK_FILE)
            if last:
                os.ftruncate(fd, 0)
                os.fsync(fd)
        except (OSError, RunDirBusy):  # a full disk must not keep the lock: closing the fd releases it
            pass
        finally:
            os.close(fd)  # closing the only descriptor drops the flock
            if gate is not None:
                os.close(gate)

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
