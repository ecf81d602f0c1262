"""Run-directory state: which run an unnamed `meshrun train` continues, and whether a run has finished.

A run without `train.name` gets a new timestamped directory, so "re-run the same command" after
a preemption, a crash or a scheduler's requeue would start over and lose the work. Instead, with
checkpoint.resume='auto', meshrun looks at the newest earlier run under train.run_dir trained with
the same settings (every section but launch, whose world size may change: checkpoints reshard,
and the run's name): when that run has a committed checkpoint and never finished (no final
weights), it is continued, unless another live run holds it (rundir/lock.py): then this is a
new run. A finished one means a new run. `--resume never` always starts anew.

A finished run has RUN/finished.json ({"step": N}), written durably by rank 0 right after
model.pt. A worker that finds it (an agent restart after the end) does not train again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from meshrun.checkpoint import manifest as mf
from meshrun.errors import ConfigError, MeshrunError, shown

CONFIG_FILE = "config.toml"
FINAL_WEIGHTS = "model.pt"  # written by the trainer at the very end of a run
FINISHED_FILE = "finished.json"  # written by the trainer after FINAL_WEIGHTS: the run is done


def _comparable(cfg) -> dict:
    data = dataclasses.asdict(cfg)
    data.pop("launch", None)
    data["train"].pop("name", None)
    return data


def write_finished(run_dir: Path, step: int) -> None:
    """Rank 0, after model.pt: the durable record that the run ended at `step` (fsync'd, atomic)."""
    path = Path(run_dir) / FINISHED_FILE
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as fp:
        fp.write(json.dumps({"step": int(step), "time": round(time.time(), 3), "weights": FINAL_WEIGHTS}) + "\n")
        fp.flush()
        os.fsync(fp.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def finished_step(run_dir: Path) -> int | None:
    """The step a finished run ended at; None while it is unfinished.

    Finished = model.pt is there and finished.json says at which step (deleting model.pt makes a
    run unfinished again). A model.pt without the marker (a run of an older meshrun, or one killed
    between the two writes) counts as finished at an unknown step: -1.
    """
    run_dir = Path(run_dir)
    if not (run_dir / FINAL_WEIGHTS).is_file():
        return None
    try:
        step = json.loads((run_dir / FINISHED_FILE).read_text()[:4096]).get("step")
    except (OSError, ValueError, AttributeError):
        return -1
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else -1


def set_aside_final(run_dir: Path, step: int) -> Path | None:
    """Before a forced start that will write model.pt again: keep the old one as model.step-N.pt."""
    weights = Path(run_dir) / FINAL_WEIGHTS
    if not weights.is_file():
        return None
    stem = f"model.step-{step:08d}" if step >= 0 else f"model.before-{time.strftime('%Y%m%d-%H%M%S')}"
    target, n = weights.with_name(f"{stem}.pt"), 1
    while target.exists():
        n += 1
        target = weights.with_name(f"{stem}-{n}.pt")
    weights.rename(target)
    (Path(run_dir) / FINISHED_FILE).unlink(missing_ok=True)
    print(f"meshrun train: kept the final weights of step {step if step >= 0 else '?'} as {target}",
          file=sys.stderr)
    return target


def unfinished_run(cfg) -> Path | None:
    """The run directory an unnamed run with `cfg` should continue, or None for a new one."""
    from meshrun.config import load_config

    root = Path(cfg.train.run_dir)
    if cfg.train.name or cfg.checkpoint.resume != "auto" or not root.is_dir():
        return None
    want = _comparable(cfg)
    runs = [p for p in root.iterdir() if (p / CONFIG_FILE).is_file()]
    for run in sorted(runs, key=lambda p: (p / CONFIG_FILE).stat().st_mtime, reverse=True):
        try:
            same = _comparable(load_config(run / CONFIG_FILE)) == want
        except (MeshrunError, OSError, ValueError):
            continue
        if same:  # the newest run of these settings decides
            finished = finished_step(run) is not None
            return None if finished or not mf.committed(mf.checkpoints_dir(run)) else run
    return None


def claim_unfinished_run(cfg, job: str | None = None):
    """(run directory, its held RunLock) of the unfinished run to continue, or None for a new run.

    A run another live `meshrun train` holds is never picked: it is being continued already.
    """
    from meshrun.rundir.lock import RunDirBusy, RunLock

    run = unfinished_run(cfg)
    if run is None:
        return None
    try:
        lock = RunLock.acquire(run, job)
    except RunDirBusy as exc:
        print(f"meshrun train: not continuing {run}: {exc}; starting a new run", file=sys.stderr)
        return None
    if unfinished_run(cfg) != run:  # it finished (or changed) while we waited for the lock
        lock.release()
        return None
    return run, lock


def claim_run_dir(cfg, job: str | None):
    """(run directory, its held RunLock): train.name's, the unfinished run an unnamed run continues,
    or a new timestamped one (created exclusively: two unnamed runs in one second get two).

    `job`: None on one node (an exclusive lock); on several, the key the launchers of this job
    share the lock under (every node runs `meshrun train` on the same directory).
    """
    from meshrun.rundir.lock import RunLock, create_unique
    from meshrun.rundir.runs import claim_unfinished_run

    root = Path(cfg.train.run_dir)
    if cfg.train.name:
        run_dir = root / cfg.train.name
        _make_dir(run_dir)
        return run_dir, RunLock.acquire(run_dir, job)  # RunDirBusy (exit 2) names the live holder
    claimed = claim_unfinished_run(cfg, job)  # an unnamed re-run continues its unfinished run, not a new one
    if claimed is not None:
        print(f"meshrun train: continuing the unfinished run {claimed[0]} (same settings, has a checkpoint); "
              "--resume never starts a new run", file=sys.stderr)
        return claimed
    _make_dir(root)
    run_dir = create_unique(root, time.strftime("%Y%m%d-%H%M%S"))
    return run_dir, RunLock.acquire(run_dir, job)


def _make_dir(path: Path) -> None:
    """mkdir -p, or one line naming train.run_dir: the checks before launch ask access(), which
    a filesystem such as /proc answers yes to and then refuses the mkdir."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"train.run_dir/train.name {shown(str(path))} cannot be created ({exc.strerror or exc}); "
                          "give a directory you can write") from None
