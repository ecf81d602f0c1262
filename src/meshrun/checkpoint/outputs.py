"""A path a command writes: never inside a checkpoint, never one of its inputs, never a file it did not make.

    check_output("--out", out, inputs=args.inputs, writes=[out / "tokens.bin", out / "meta.json"],
                 force=args.force, ours=made_by_prepare)

Called by every command that writes where a user points it (`ckpt export`, `data prepare`,
`report --out`) before it creates anything. One line (ConfigError, exit 2) when:
- OUT is or lies inside a checkpoint, or a run's checkpoints/ directory: a file there marks the
  checkpoint invalid, or changes what a resume reads (always refused);
- OUT is an input, lies inside an input directory, or a file it writes is an input (always refused);
- a file it writes exists and `ours(file)` does not say the command made it (refused unless --force).
`meshrun generate` writes to stdout only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from meshrun.checkpoint import manifest as mf
from meshrun.errors import ConfigError, shown


def check_output(flag: str, out: str | os.PathLike[str], *, inputs: Iterable[str | os.PathLike[str]] = (),
                 writes: Iterable[str | os.PathLike[str]] | None = None, force: bool = False,
                 ours: Callable[[Path], bool] | None = None) -> None:
    out = Path(out).expanduser()
    written = [Path(w).expanduser() for w in (writes if writes is not None else [out])]
    where = f"{flag} {shown(str(out))}"
    for path in (out, *written):
        held = mf.holder(path)
        if held is not None:
            what = "a run's checkpoints directory" if held.name == mf.CHECKPOINTS else "the checkpoint"
            raise ConfigError(f"{where} is inside {what} {shown(str(held))}: a file written there marks a "
                              "checkpoint invalid or changes what a resume reads; give a path outside it")
    for given in inputs:
        source = Path(given).expanduser()
        if not (source.exists() or source.is_symlink()):
            continue
        if _same(out, source):
            raise ConfigError(f"{where} is the input {shown(str(given))}: writing it would destroy it; "
                              "give a new path")
        if source.is_dir() and _inside(out, source):
            raise ConfigError(f"{where} is inside the input directory {shown(str(given))}; give a path "
                              "outside it")
        for path in written:
            if _same(path, source):
                raise ConfigError(f"{where}: it would write {shown(str(path))}, which is the input "
                                  f"{shown(str(given))}; give another {flag}")
    if force:
        return
    for path in written:
        if (path.exists() or path.is_symlink()) and not (ours is not None and ours(path)):
            named = "" if path == out else f": {shown(str(path))}"
            raise ConfigError(f"{where}{named} exists, and this command did not write it; give a new path, "
                              "or --force to replace it")


def _real(path: Path) -> str:
    return os.path.realpath(path)


def _same(a: Path, b: Path) -> bool:
    """The same file: one path, or two names (a symlink, a hard link) of one inode."""
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: Path, directory: Path) -> bool:
    return Path(_real(path)).is_relative_to(Path(_real(directory)))
