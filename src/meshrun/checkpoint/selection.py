"""Which checkpoint a run resumes from: `checkpoint.resume` = auto, never or a PATH, and restarts.

Runs on rank 0 only, before the load; the others receive its choice.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.retire import retire, set_aside

logger = logging.getLogger(__name__)


def choose(root: Path, resume: str, *, session: int) -> Path | None:
    """auto: the newest valid; never / PATH: that, but a restart (--max-restarts) keeps this job's progress."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if resume == "auto" or (resume == "never" and restart):
        return latest_valid(root)
    if resume == "never":
        abandon_after(root, 0, "starting fresh (--resume never)", session=session)
        return None
    path = Path(resume)
    bad = mf.problem(path)
    if bad:
        raise mf.CheckpointError(f"checkpoint.resume={resume!r}: {bad}")
    step = int(mf.read_manifest(path)["step"])
    if restart:
        own = latest_valid(root)
        return own if own is not None and int(mf.read_manifest(own)["step"]) > step else path
    abandon_after(root, step, f"resuming from {path} (step {step})", session=session, keep=path)
    return path


def abandon_after(root: Path, step: int, why: str, *, session: int, keep: Path | None = None) -> None:
    """Later checkpoints of this run belong to another timeline: rename them so auto never picks them."""
    for later in mf.committed(root):
        if int(later.name.split("-")[1]) > step and (keep is None or later.resolve() != keep.resolve()):
            target = set_aside(later, tag=session)
            logger.warning("meshrun: %s: renamed the checkpoint %s to %s so that restarts never return to it",
                           why, later.name, target.name)


def latest_valid(root: Path) -> Path | None:
    for candidate in mf.committed(root):
        bad = mf.problem(candidate)
        if bad is None:
            return candidate
        logger.warning("meshrun: skipping damaged checkpoint %s: %s", candidate.name, bad)
    return None


def drop_uncommitted(root: Path, *, session: int) -> None:
    for tmp in mf.uncommitted(root):
        logger.warning("meshrun: ignoring incomplete checkpoint %s (the write never committed); removing it",
                       tmp.name)
        retire(tmp, "an incomplete checkpoint", tag=session)


def resume_by_step(resume: str, run_dir: Path | None) -> str:
    """`--resume step-00000010`, `step-10` or `10`: that checkpoint of `run_dir` as a path (when no
    such file or directory exists where the command runs); anything else as it was. `run_dir`
    None (an unnamed run): a step alone names no run, one line."""
    import re

    match = re.fullmatch(r"(?:step-)?(\d+)", resume)
    if match is None or os.path.exists(resume):
        return resume
    if run_dir is None:
        from meshrun.errors import ConfigError

        raise ConfigError(f"--resume {resume}: a step names a checkpoint of a named run; add "
                          "--set train.name=NAME, or give the checkpoint's path (`meshrun ckpt list runs/NAME`)")
    path = mf.checkpoints_dir(run_dir) / mf.step_dir_name(int(match[1]))
    if not path.exists():
        from meshrun.errors import ConfigError

        held = [p.name for p in reversed(mf.committed(mf.checkpoints_dir(run_dir)))]
        has = f"its checkpoints: {', '.join(held)}" if held else "it has no checkpoint yet"
        raise ConfigError(f"--resume {resume}: run {run_dir} has no checkpoint at step {int(match[1])} ({has}; "
                          f"see `meshrun ckpt list {run_dir}`)")
    return str(path)
