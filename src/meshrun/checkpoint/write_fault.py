"""A checkpoint write that failed on a full, read-only or failing disk: what failed, and how much it needs.

A failed save never reaches the commit (manifest, rename, `latest`), so the previous checkpoint
stays the one resumed from; manager.py removes the `.tmp-*` directory and raises the
DiskWriteError built here: one line naming the path, the reason, the bytes a checkpoint needs
and the bytes free. torch.save reports a failed write as a RuntimeError from its zip writer
("unexpected pos ..."), with the OSError only as its context, and DCP sends other ranks'
failures pickled, without that context: `write_failure` finds the errno where it survives and
otherwise reads the filesystem (read-only flag, free space, file-size limit).
"""

from __future__ import annotations

import errno
import os
import resource
from datetime import timedelta
from pathlib import Path

from meshrun.checkpoint import manifest as mf
from meshrun.errors import DiskWriteError
from meshrun.runtime.diskfault import disk_fault, disk_write_error, free_bytes

# torch's zip writer (caffe2/serialize/inline_container.cc) when the file under it stops taking bytes
_TORCH_WRITE_FAILED = ("unexpected pos", "failed writing file", "file write failed")


def write_failure(exc: BaseException) -> OSError | None:
    """The OSError behind a failed checkpoint write, else None (not a write failure: re-raise it).

    Looks through the exception's causes and, for DCP's CheckpointException, every rank's.
    A torch writer failure without an errno gets errno 0, for `guess_errno` to fill in.
    """
    candidates = [exc]
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        candidates += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
    for candidate in candidates:
        if isinstance(candidate, BaseException):
            found = disk_fault(candidate)
            if found is not None:
                return found
    text = " ".join(str(c) for c in candidates if isinstance(c, BaseException))
    if any(pattern in text for pattern in _TORCH_WRITE_FAILED):
        return OSError(0, "the write failed")
    return None


def guess_errno(path: Path, needed: int | None) -> int:
    """Why a write without an errno failed, read from the filesystem: EROFS, ENOSPC, EFBIG or EIO."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return errno.EROFS
    except OSError:
        pass
    free = free_bytes(path)
    if needed and free is not None and free < needed:
        return errno.ENOSPC
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and (needed is None or limit < needed):
        return errno.EFBIG
    return errno.EIO


def with_errno(exc: OSError, path: Path, needed: int | None) -> OSError:
    """`exc` itself, or for errno 0 an OSError with the errno guess_errno reads from the filesystem."""
    if exc.errno:
        return exc
    code = guess_errno(path, needed)
    return OSError(code, os.strerror(code), exc.filename)


def checkpoint_bytes(root: Path) -> int | None:
    """Bytes of the newest committed checkpoint, from its manifest (None: none yet, or unreadable)."""
    for ckpt in mf.committed(root):
        try:
            return sum(int(entry["bytes"]) for entry in mf.read_manifest(ckpt)["files"].values())
        except (mf.CheckpointError, KeyError, TypeError, ValueError):
            continue
    return None


def state_bytes(tree) -> int:
    """An estimate of a checkpoint of `tree` (nested dicts/lists of tensors): their global sizes."""
    if isinstance(tree, dict):
        return sum(state_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(v) for v in tree)
    shape, itemsize = getattr(tree, "shape", None), getattr(tree, "itemsize", None)
    if shape is None or itemsize is None:
        return 0
    count = 1
    for dim in shape:  # a DTensor's shape is the global one
        count *= int(dim)
    return count * int(itemsize)


def write_failed(exc: OSError, *, tmp: Path, root: Path, needed: int | None) -> DiskWriteError:
    """The one line for a checkpoint that could not be written (see the module docstring)."""
    exc = with_errno(exc, root, needed)
    previous = mf.read_latest(root)
    kept = (f"{previous} is intact and `latest` still names it" if previous
            else "no earlier checkpoint was written")
    after = f"{kept}; free space there (or move train.run_dir), then re-run the same command" + (
        " to resume from it" if previous else "")
    return disk_write_error(exc, exc.filename or tmp, what=f"checkpoint {tmp.name.split('.tmp-')[0]}",
                            needed=needed, after=after)


def first_failure(local: OSError | None) -> OSError | None:
    """The lowest rank's write failure, on every rank (None when every rank wrote)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    mine = None if local is None else (local.errno, local.strerror, local.filename)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    first = next((f for f in every if f is not None), None)
    return None if first is None else OSError(*first)


def store_signal(key: str, *, set_it: bool, wait_s: float = 10.0) -> None:
    """Rank 0 sets `key` in the job's store; the others wait for it, at most wait_s (never a collective)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        if set_it:
            store.set(key, "1")
        else:
            store.wait([key], timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - only an ordering nicety; the error is raised either way
        pass
