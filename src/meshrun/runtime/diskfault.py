"""A failed write (no space, read-only filesystem, I/O error) as one line naming the path and the space needed.

Checkpoints and metrics call `disk_write_error(exc, path, ...)` for an OSError whose errno
`is_disk_fault`; the job then stops with that line (DiskWriteError, exit 1), not a traceback.
Standard library only.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from meshrun.errors import DiskWriteError

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def disk_fault(exc: BaseException | None) -> OSError | None:
    """The OSError with a disk errno in `exc` or its causes (DCP wraps a writer's), else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def human_bytes(count: float) -> str:
    """A byte count in binary units, as people read it: '512 B', '256.0 KiB', '2.1 MiB', '3.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"  # unreachable; keeps type checkers content


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent); None if unknown."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def disk_write_error(exc: OSError, path: str | Path, *, what: str, needed: int | None = None,
                     after: str = "") -> DiskWriteError:
    """DiskWriteError: '<what> could not be written to <path>: <reason>; it needs about N, M free; <after>'."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    reason = f"{exc.strerror or exc} ({name})"
    where = exc.filename or path
    text = f"{what} could not be written to {os.fspath(where)}: {reason}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = free_bytes(path)
        sizes = [f"needs about {human_bytes(needed)}" if needed else "", f"{human_bytes(free)} free there"
                 if free is not None else ""]
        text += "; " + ", ".join(s for s in sizes if s) if any(sizes) else ""
    if exc.errno == errno.EFBIG:
        text += " (a file-size limit: see `ulimit -f`)"
    return DiskWriteError(f"{text}; {after}" if after else text)
