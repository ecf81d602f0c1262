"""A run's history is append-only: what a new start of an existing run directory may do, decided before launch.

`meshrun train` calls `plan_start` once it holds the run directory's lock. Anything that would
discard or rewrite what the run has (train again a finished run, roll back to an earlier
checkpoint, resume beyond train.steps, replace config.toml with other settings) is refused with
one line saying what it would do, unless `--force`; with --force it is done in the open: each
action is printed, later checkpoints are renamed `*.abandoned-<session>` (selection.py), the old
model.pt is kept as model.step-N.pt, the old config.toml as config.before-<time>.toml.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from meshrun.checkpoint import manifest as mf
from meshrun.errors import ConfigError, MeshrunError
from meshrun.rundir.runs import CONFIG_FILE, finished_step, set_aside_final

FORCE_HINT = "add --force to do so, or start a new run with --set train.name=NEW"
# Per-start choices, not the run's settings: they may differ from start to start.
# Keys a later start may change freely: where and how to start, and what is recorded about the run
# (metrics cadence, trackers), how often memory snapshots are taken: none of them changes the
# weights, so none needs --force. (A snapshot taken under another config.toml is not resumed from:
# checkpoint/snapshot.py compares them, and the disk checkpoint is used.)
_PER_START = {"launch", "checkpoint.resume", "checkpoint.snapshot_interval", "train.name", "train.run_dir", "metrics"}


@dataclasses.dataclass
class StartPlan:
    """What this start does: resume from `resume` (the workers' --resume), write config.toml or not."""

    resume: str
    write_config: bool
    finished: str | None = None  # set: the run is done and nothing differs; say this and exit 0


def saved_form(cfg):
    """The config as a run directory keeps it: the run's settings, with no per-start resume choice."""
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))


def first_difference(saved, cfg) -> str | None:
    """'section.key=new (this run has old)' for the first setting that differs, per-start keys aside."""
    old, new = dataclasses.asdict(saved), dataclasses.asdict(cfg)
    for section, values in new.items():
        for key, value in values.items():
            if section in _PER_START or f"{section}.{key}" in _PER_START:
                continue
            if old.get(section, {}).get(key) != value:
                return f"{section}.{key}={value!r} (was {old.get(section, {}).get(key)!r})"
    return None


def _names(paths: list[Path], limit: int = 3) -> str:
    names = ", ".join(p.name for p in paths[:limit])
    return names + (f" (and {len(paths) - limit} more)" if len(paths) > limit else "")


def _step(path: Path) -> int:
    return int(path.name.split("-")[1])


def _discards(run_dir: Path, cfg) -> tuple[str, str | None]:
    """(the resume the workers get, what it would set aside or None) for `checkpoint.resume`."""
    resume, steps = cfg.checkpoint.resume, cfg.train.steps
    ckpts = mf.committed(mf.checkpoints_dir(run_dir))  # by name: the workers skip damaged ones themselves
    aside = "renamed *.abandoned-<session>, never resumed again"
    if resume == "never":
        return resume, (f"--resume never starts {run_dir} over: its checkpoints {_names(ckpts)} would be "
                        f"set aside ({aside})") if ckpts else None
    if resume != "auto":
        path = Path(resume)
        step = int(mf.read_manifest(path)["step"])
        later = [c for c in ckpts if _step(c) > step and c.resolve() != path.resolve()]
        return resume, (f"--resume {resume} rolls {run_dir} back to step {step}: its later checkpoints "
                        f"{_names(later)} would be set aside ({aside})") if later else None
    later = [c for c in ckpts if _step(c) > steps]
    if not later:
        return resume, None
    earlier = [c for c in ckpts if _step(c) <= steps]
    target = str(earlier[0]) if earlier else "never"
    back = f"roll back to {earlier[0].name}" if earlier else "start over"
    return target, (f"{run_dir}: its latest checkpoint {later[0].name} is beyond train.steps={steps}, and a "
                    f"run never trains past its end; resuming would {back} and set aside {_names(later)} "
                    f"({aside})")


def _saved_config(run_dir: Path):
    from meshrun.config import load_config

    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except MeshrunError as exc:
        raise ConfigError(f"{path} does not load ({exc}); move it away or start a new run with "
                          "--set train.name=NEW") from None


def plan_start(run_dir: Path, cfg, *, force: bool) -> StartPlan:
    """Check this start against what `run_dir` holds; raise ConfigError (exit 2) unless it only appends.

    With `force` every check passes, and what it discards is printed and done here (final
    weights, config.toml) or by the workers (later checkpoints, selection.py).
    """
    run_dir = Path(run_dir)
    saved = _saved_config(run_dir)
    changed = first_difference(saved, cfg) if saved is not None else None
    finished = finished_step(run_dir)
    resume, discards = _discards(run_dir, cfg)
    actions = [discards] if discards else []
    if finished is not None:
        at = f"step {finished}" if finished >= 0 else "its end"
        again = changed or (f"--resume {cfg.checkpoint.resume}" if cfg.checkpoint.resume != "auto" else None)
        if again is None and not discards and finished in (-1, cfg.train.steps):
            return StartPlan(resume, write_config=False, finished=(
                f"{run_dir} finished at {at} ({run_dir}/model.pt); nothing to do. To train more: a new run "
                "(--set train.name=NEW), or this one further with a higher train.steps and --force"))
        kept = f"model.step-{finished:08d}.pt" if finished >= 0 else "model.before-<time>.pt"
        actions.append(f"{run_dir} finished at {at}; training it again ({again or 'this start'}) would "
                       f"replace its model.pt (kept as {kept})")
    if changed:
        actions.append(f"{run_dir}/{CONFIG_FILE} holds this run's settings, and this start differs: {changed}; "
                       "continuing with the new ones replaces it (the old one kept as config.before-<time>.toml)")
    if actions and not force:
        raise ConfigError(f"{actions[0]}; {FORCE_HINT}")
    for action in actions:
        print(f"meshrun train: --force: {action.replace(' would ', ' will ')}", file=sys.stderr)
    if finished is not None:
        set_aside_final(run_dir, finished)
    if saved is not None and changed:
        _keep_old_config(run_dir)
    return StartPlan(resume, write_config=saved is None or changed is not None)


def _keep_old_config(run_dir: Path) -> None:
    old = run_dir / CONFIG_FILE
    target = run_dir / f"config.before-{time.strftime('%Y%m%d-%H%M%S')}.toml"
    n = 1
    while target.exists():
        n += 1
        target = run_dir / f"config.before-{time.strftime('%Y%m%d-%H%M%S')}-{n}.toml"
    old.rename(target)
    print(f"meshrun train: kept the previous {old} as {target.name}", file=sys.stderr)
