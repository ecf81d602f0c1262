"""What every experiment tracker adapter shares: its protocol, its ids kept across resumes, scalars.

The adapters are tracker_adapters.py's; TrackerSet (trackers.py) opens and drives them.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
TENSORBOARD_DIR = "tb"
PROJECT = "meshrun"  # the MLflow experiment, W&B project and trackio project, unless the user names one
MAX_STATE_BYTES = 64 * 1024


class Tracker(Protocol):
    """What each tracker adapter provides (tracker_adapters.py has them all)."""

    name: str

    def log(self, values: dict[str, float], step: int) -> None: ...

    def summary(self, values: dict[str, Any], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 20}} -> {"train.steps": 20}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite int/float values (not bools): what every tracker takes as a scalar."""
    return {key: value for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class TrackerState:
    """runs/<name>/trackers.json: the ids a resumed run needs to continue the same tracker runs.
    A damaged or oversized file is ignored (new tracker runs), never a crash."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / STATE_FILE
        self.values: dict[str, str] = {}
        try:
            if self.path.is_file() and self.path.stat().st_size <= MAX_STATE_BYTES:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                if isinstance(data, dict):
                    self.values = {k: v for k, v in data.items() if isinstance(v, str)}
        except (OSError, ValueError):
            logger.warning("meshrun: %s is unreadable; trackers start new runs", self.path)

    def get(self, key: str) -> str | None:
        return self.values.get(key)

    def put(self, key: str, value: str) -> None:
        self.values[key] = value
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.values, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
