"""The launcher's side of in-memory snapshots: one /dev/shm directory per `meshrun train`, removed at its end.

    with snapshot_area(enabled=fixed_interval(cfg.checkpoint.snapshot_interval) != 0):
        run_spec(plan)          # the workers find the directory in MESHRUN_SNAPSHOT_DIR

The directory outlives every worker (a restart finds its predecessors' snapshots) and no longer
than the launcher: it is removed when `meshrun train` returns or raises. A launcher that was
itself SIGKILLed cannot clean up; the next `meshrun train` on this host removes directories
whose owner pid is gone (by pid, never by name). A fresh directory per launcher also means a
restart never sees snapshots of another timeline (a rollback, a `--resume never`).
Standard library only: the CLI imports it before torch.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

ENV = "MESHRUN_SNAPSHOT_DIR"
ROOT_ENV = "MESHRUN_SNAPSHOT_ROOT"  # where the per-launcher directories go; default /dev/shm
PREFIX = "meshrun-"


def fixed_interval(value: str | int) -> int | None:
    """checkpoint.snapshot_interval as a number: None for 'auto' (chosen by its measured cost), 0 = off."""
    return None if str(value) == "auto" else int(value)


def shm_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or "/dev/shm")


def _owner_pid(path: Path) -> int | None:
    parts = path.name.removeprefix(PREFIX).split("-")
    return int(parts[0]) if len(parts) == 2 and parts[0].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: Path) -> list[Path]:
    """Remove this user's snapshot directories whose launcher (by pid) no longer runs."""
    removed = []
    for path in root.glob(f"{PREFIX}*-*"):
        pid = _owner_pid(path)
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if pid is not None and mine and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def snapshot_area(*, enabled: bool) -> Iterator[Path | None]:
    """Create this launcher's directory and name it in MESHRUN_SNAPSHOT_DIR for the workers."""
    root = shm_root()
    if not enabled or not root.is_dir() or not os.access(root, os.W_OK):
        yield None
        return
    remove_stale(root)
    path = root / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    before = os.environ.get(ENV)
    os.environ[ENV] = str(path)
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        shutil.rmtree(path, ignore_errors=True)
