"""A checkpoint directory that has to go: deleted only when it is provably meshrun's own, else set aside.

    retire(path, "rotated out (keep=2)", tag=session)   # a checkpoint older than the last `keep`
    retire(tmp, "its write never committed", tag=session)

A directory goes when every file in it is one a save writes (checkpoint/manifest.py
`foreign_files`) and, for a committed one, its manifest still lists exactly those files at their
sizes. Anything else (a user's export written into it, a damaged or foreign directory) is renamed
NAME.abandoned-TAG next to it and kept, with a warning that names both: a resume or a rotation
never deletes a file meshrun did not write. Listings skip such directories.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from meshrun.checkpoint import manifest as mf

logger = logging.getLogger(__name__)


def retire(path: Path, why: str, *, tag: int | str) -> Path | None:
    """Delete `path` (None) when it is meshrun's own, else rename it aside (the new path)."""
    path = Path(path)
    reason = _not_own(path)
    if reason is None:
        shutil.rmtree(path, ignore_errors=True)
        return None
    target = set_aside(path, tag=tag)
    logger.warning("meshrun: %s: kept %s as %s instead of deleting it (%s); delete it yourself when it "
                   "is not needed", why, path.name, target.name, reason)
    return target


def set_aside(path: Path, *, tag: int | str) -> Path:
    """Rename `path` to NAME.abandoned-TAG (-2, -3, ... when taken): a name no listing or resume picks."""
    target = path.with_name(f"{path.name}{mf.ABANDONED}{tag}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}{mf.ABANDONED}{tag}-{n}")
    path.rename(target)
    return target


def _not_own(path: Path) -> str | None:
    """Why `path` may hold something that is not meshrun's, or None when it is provably its own."""
    if path.is_symlink() or not path.is_dir():
        return "it is not a directory meshrun made"
    foreign = mf.foreign_files(path)
    if foreign:
        return f"it holds {foreign[0].relative_to(path)}, which no save writes"
    if ".tmp-" in path.name:
        return None  # a write that never committed: only save's own files, no manifest to match
    bad = mf.problem(path, checksums=False)
    return None if bad is None else bad
