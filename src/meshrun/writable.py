"""Can this process create (or write into) a directory? Answered without creating anything.

Used for `train.run_dir` and `--log-dir` before any directory exists, so that a mistake is one
line and leaves nothing behind:

    check_creatable_dir("runs/my-run", "train.run_dir", fix="set train.run_dir to a directory you own")
"""

from __future__ import annotations

import os
from pathlib import Path

from meshrun.errors import ConfigError, MeshrunError

NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4096  # bytes in a whole path (Linux)


def _limit(path: str, name: int, default: int) -> int:
    try:
        return int(os.pathconf(path, name))
    except (OSError, ValueError):
        return default


def check_creatable_dir(path: str | os.PathLike[str], what: str, *, fix: str,
                        error: type[MeshrunError] = ConfigError) -> None:
    """Raise `error` (one line naming `what`, the path and `fix`) unless `path` is a writable
    directory or one that mkdir -p could create here. Creates nothing."""
    text = os.fspath(path)
    shown = text if len(text) <= 80 else text[:60] + "..." + text[-12:]
    if "\x00" in text:
        raise error(f"{what} {shown!r} contains a NUL byte; {fix}")
    if not text.strip():
        raise error(f"{what} is empty; {fix}")
    target = Path(text).expanduser().absolute()
    ancestor = target
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    name_max = _limit(str(ancestor), "PC_NAME_MAX", NAME_MAX)
    for part in target.parts:
        if len(os.fsencode(part)) > name_max:
            raise error(f"{what} {shown!r}: the name {part[:20]!r}... is {len(os.fsencode(part))} bytes, "
                        f"more than this file system's {name_max}; {fix}")
    if len(os.fsencode(str(target))) >= _limit(str(ancestor), "PC_PATH_MAX", PATH_MAX):
        raise error(f"{what} {shown!r} is longer than the system's path limit; {fix}")
    if ancestor.exists() and not ancestor.is_dir() or os.path.islink(ancestor) and not ancestor.exists():
        kind = "is a file" if ancestor == target else f"cannot be created: {str(ancestor)!r} is a file"
        raise error(f"{what} {shown!r} {kind}, not a directory; {fix}")
    if not os.access(ancestor, os.W_OK | os.X_OK) or _read_only(ancestor):
        where = "" if ancestor == target else f": {str(ancestor)!r} is not writable"
        state = "is not writable" if ancestor == target else "cannot be created"
        raise error(f"{what} {shown!r} {state}{where}; {fix}")


def _read_only(path: Path) -> bool:
    """True on a read-only mount (os.access says yes to root even there)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False
