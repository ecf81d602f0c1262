"""Which run directory an unnamed `meshrun train` continues.

A run without `train.name` gets a new timestamped directory, so "re-run the same command" after
a preemption, a crash or a scheduler's requeue would start over and lose the work. Instead, with
checkpoint.resume='auto', meshrun looks at the newest earlier run under train.run_dir trained with
the same settings (every section but launch, whose world size may change: checkpoints reshard,
and the run's name): when that run has a committed checkpoint and never finished (no final
weights), it is continued. A finished one means a new run. `--resume never` always starts anew.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshrun.checkpoint import manifest as mf
from meshrun.errors import MeshrunError

CONFIG_FILE = "config.toml"
FINAL_WEIGHTS = "model.pt"  # written by the trainer at the very end of a run


def _comparable(cfg) -> dict:
    data = dataclasses.asdict(cfg)
    data.pop("launch", None)
    data["train"].pop("name", None)
    return data


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
            finished = (run / FINAL_WEIGHTS).exists()
            return None if finished or not mf.committed(mf.checkpoints_dir(run)) else run
    return None
