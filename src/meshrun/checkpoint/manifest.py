"""Checkpoint directory layout, the manifest written at commit, and verification on load.

    RUN/checkpoints/step-00000010/        a committed checkpoint (renamed from a .tmp-* name)
        .metadata, __0_0.distcp, ...       torch.distributed.checkpoint files (model + optimizer)
        train_state.pt                     step, LR schedule, data position, layout, config
        rng/rank-00000.pt                  each rank's RNG states
        manifest.json                      every file above with its size and sha256, written last
    RUN/checkpoints/latest                 the name of the newest committed checkpoint

A directory without a manifest never finished; one whose files differ from their manifest
entry is damaged. Either is skipped with a warning that names it and the bad file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from meshrun.checkpoint.schema import MAX_MANIFEST_BYTES, SELF_SHA, VERSION, check_manifest
from meshrun.errors import MeshrunError

MANIFEST = "manifest.json"
LATEST = "latest"
CHECKPOINTS = "checkpoints"
TRAIN_STATE = "train_state.pt"
DCP_METADATA = ".metadata"
_COMMITTED = re.compile(r"^step-(\d{8})$")
ABANDONED = ".abandoned-"
# Every file a save writes into its directory (torch's DCP files, meshrun's own): a directory that
# holds only these is meshrun's own, and only such a one is ever deleted (checkpoint/retire.py).
_OWN_FILE = re.compile(r"^(\.metadata(\.tmp)?|__\d+(_\d+\.distcp|\.metadata(\.tmp)?)|train_state\.pt|"
                       r"manifest\.json(\.tmp)?|rng/rank-\d{5}\.pt)$")


class CheckpointError(MeshrunError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model being trained."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, newest (highest step) first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _COMMITTED.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def uncommitted(root: Path) -> list[Path]:
    """Temporary directories of writes that never committed (a crash or kill mid-save)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and ".tmp-" in p.name and ABANDONED not in p.name)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fp:
        for block in iter(lambda: fp.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a manifest holds")


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


def _canonical(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True)


def write_manifest(ckpt: Path, **info) -> dict:
    """Record every file's size and sha256, and the manifest's own; fsync'd, so a committed one is on disk."""
    files = {p.relative_to(ckpt).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(ckpt)}
    manifest = {"version": VERSION, **info, "files": files}
    manifest[SELF_SHA] = hashlib.sha256(_canonical(manifest).encode()).hexdigest()
    tmp = ckpt / (MANIFEST + ".tmp")
    try:
        with open(tmp, "w") as fp:
            fp.write(_canonical(manifest))
            fp.flush()
            os.fsync(fp.fileno())
        tmp.replace(ckpt / MANIFEST)
    except OSError:  # a full disk: no partial manifest is left to look like a commit
        tmp.unlink(missing_ok=True)
        raise
    return manifest


def read_manifest(ckpt: Path) -> dict:
    """The manifest of `ckpt`, checked byte for byte and field by field; any flaw is a CheckpointError."""
    import stat

    path = Path(ckpt) / MANIFEST
    try:
        with open(path, "rb", opener=_no_block) as fp:  # a FIFO in its place never blocks the reader
            if not stat.S_ISREG(os.fstat(fp.fileno()).st_mode):
                raise ValueError("not a regular file")
            data = fp.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"more than the {MAX_MANIFEST_BYTES} bytes a manifest holds")
        text = data.decode("utf-8")
        manifest = json.loads(text, parse_constant=_no_constant)
        check_manifest(manifest, text, step_dir=Path(ckpt).name)
    except (OSError, ValueError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc})") from None
    return manifest


def problem(ckpt: Path, *, checksums: bool = True) -> str | None:
    """None when `ckpt` is complete and intact, else what is wrong, naming the bad file. Never raises."""
    ckpt = Path(ckpt)
    try:
        if not ckpt.is_dir():
            return f"{ckpt} is not a directory"
        if not (ckpt / MANIFEST).is_file():
            return f"{ckpt} has no {MANIFEST}: its write never committed"
        files = read_manifest(ckpt)["files"]
        for rel, entry in files.items():
            path = ckpt / rel
            if not path.is_file():
                return f"{path} is missing"
            size = path.stat().st_size
            if size != entry["bytes"]:
                return f"{path} is {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
            if checksums and _sha256(path) != entry["sha256"]:
                return f"{path} fails its sha256 check (corrupt)"
        extra = [p for p in _files(ckpt) if p.relative_to(ckpt).as_posix() not in files]
        if extra:
            return f"{extra[0]} is not in the {MANIFEST}: the directory changed after it was written"
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"{ckpt} is unreadable ({exc})"
    return None


def foreign_files(ckpt: Path) -> list[Path]:
    """Files under `ckpt` that no save writes (a user's export, a note): [] for meshrun's own directory."""
    return [p for p in sorted(Path(ckpt).rglob("*"))
            if not p.is_dir() and not _OWN_FILE.match(p.relative_to(ckpt).as_posix())]


def holder(path: Path) -> Path | None:
    """The checkpoint, or run's checkpoints/ directory, that `path` is or lies inside; None if none.
    A file written there changes what a resume reads, or marks a checkpoint invalid."""
    try:
        here = Path(path).expanduser().resolve()
    except (OSError, RuntimeError):
        return None
    for p in (here, *here.parents):
        if is_checkpoint(p) or (p.name == CHECKPOINTS and ((p / LATEST).exists() or committed(p))):
            return p
    return None


def is_checkpoint(path: Path) -> bool:
    """Does `path` look like a meshrun checkpoint at all (valid or not)? A path the filesystem
    refuses (a name too long, a directory it cannot search) does not: `unusable` says why."""
    path = Path(path)
    try:
        return path.is_dir() and ((path / MANIFEST).is_file() or (path / DCP_METADATA).is_file())
    except OSError:
        return False


def unusable(path: Path) -> str | None:
    """Why the filesystem refuses to look at `path` at all (e.g. 'File name too long'), or None."""
    try:
        Path(path).exists()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def write_latest(root: Path, name: str) -> None:
    """Point `latest` at `name` atomically: on a failed write (a full disk) it still names the old one."""
    tmp = root / (LATEST + ".tmp")
    try:
        tmp.write_text(name + "\n")
        tmp.replace(root / LATEST)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


LATEST_LIMIT = 4096  # a checkpoint's directory name and a newline


def read_latest(root: Path) -> str | None:
    """The name `latest` points at; None when it is missing or is not what write_latest writes (a
    FIFO or a device in its place would block or never end: only a small regular file is read)."""
    import stat

    try:
        with open(root / LATEST, "rb", opener=_no_block) as fp:
            if not stat.S_ISREG(os.fstat(fp.fileno()).st_mode):
                return None
            data = fp.read(LATEST_LIMIT + 1)
    except OSError:
        return None
    if len(data) > LATEST_LIMIT:
        return None
    try:
        return data.decode("utf-8").strip() or None
    except UnicodeDecodeError:
        return None


def _no_block(path: str, flags: int) -> int:
    """Open without waiting: a FIFO opened for reading would wait for a writer."""
    return os.open(path, flags | os.O_NONBLOCK)
