"""Experiment trackers on rank 0: every metrics row, the config and the end-of-run summary, sent to
TensorBoard, MLflow, W&B and trackio as `[metrics] trackers` asks (docs/metrics.md).

    trackers = TrackerSet.open(("mlflow", "wandb"), run_dir, config=as_dict(cfg))
    trackers.log("train", 10, {"loss": 2.3, "lr": 3e-4})   # -> train/loss, train/lr at step 10
    trackers.summary({"final_loss": 2.1}); trackers.close()

Each writes local files under the run directory unless the user points it elsewhere (MLflow: a
file store in runs/<name>/mlruns; W&B: offline, runs/<name>/wandb; trackio: runs/<name>/trackio).
A tracker never stops training: the first exception it raises (at open or later) is one warning
line, and that tracker is off for the rest of the run; metrics.jsonl still has every row.
A resumed run continues the same tracker run: ids are kept in runs/<name>/trackers.json.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
TENSORBOARD_DIR = "tb"
PROJECT = "meshrun"  # the MLflow experiment, W&B project and trackio project, unless the user names one
MAX_STATE_BYTES = 64 * 1024


class Tracker(Protocol):
    """What each tracker adapter provides (meshrun.metrics.trackers_hosted has the other three)."""

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


class TensorBoardTracker:
    """torch.utils.tensorboard's SummaryWriter in runs/<name>/tb (a resumed run adds event files)."""

    name = "tensorboard"

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, run_dir: Path, state: TrackerState | None, config: dict[str, Any], run_name: str) -> TensorBoardTracker:
        with warnings.catch_warnings():  # its import chain warns about deprecated modules
            warnings.simplefilter("ignore")
            from torch.utils.tensorboard import SummaryWriter
        tracker = cls(SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR)))
        if config:
            rows = "\n".join(f"| {key} | {value!r} |" for key, value in config.items())
            tracker.writer.add_text("config", "| key | value |\n|---|---|\n" + rows)
        return tracker

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.log({f"summary/{k}": v for k, v in numeric(values).items()}, step)
        self.writer.add_text("summary", "\n".join(f"{k}: {v}" for k, v in values.items()), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _openers() -> dict[str, Any]:
    from meshrun.metrics import trackers_hosted as hosted

    return {"tensorboard": TensorBoardTracker.open, "mlflow": hosted.MlflowTracker.open,
            "wandb": hosted.WandbTracker.open, "trackio": hosted.TrackioTracker.open}


class TrackerSet:
    """The open trackers; each call goes to every one, and one that raises is switched off."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = list(trackers)

    @classmethod
    def open(cls, names: tuple[str, ...], run_dir: str | Path, *, config: Mapping[str, Any] | None = None,
             extra: list[Tracker] | None = None) -> TrackerSet:
        """Open each named tracker (rank 0 only: the caller decides); one that fails to open is a
        warning line and left out. `extra`: trackers opened already (best-effort TensorBoard)."""
        run_dir = Path(run_dir)
        opened: list[Tracker] = list(extra or [])
        if not names:
            return cls(opened)
        state, flat = TrackerState(run_dir), flat_config(config or {})
        openers = _openers()
        for name in names:
            try:
                opened.append(openers[name](run_dir, state, flat, run_dir.resolve().name))
            except Exception as exc:  # noqa: BLE001 - a tracker must never stop training
                _warn_off(name, "could not start", exc)
        return cls(opened)

    @property
    def names(self) -> list[str]:
        return [tracker.name for tracker in self.trackers]

    def log(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        """One metrics row as `kind/key` scalars (eval_loss -> eval/loss, as TensorBoard always had)."""
        scalars = {f"{kind}/{key.removeprefix('eval_')}": value for key, value in numeric(values).items()}
        if scalars:
            self._each("log", scalars, int(step))

    def summary(self, values: Mapping[str, Any], step: int) -> None:
        self._each("summary", {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))}, int(step))

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")
        self.trackers = []

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker must never stop training
                self.trackers.remove(tracker)
                _warn_off(tracker.name, f"failed in {method}()", exc)
                if method != "close":
                    try:
                        tracker.close()
                    except Exception:  # noqa: BLE001, S110 - already reported; closing is best effort
                        pass


def _warn_off(name: str, what: str, exc: BaseException) -> None:
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    logger.warning("meshrun: tracker %s %s (%s); it is off for the rest of this run "
                   "(metrics.jsonl has every row)", name, what, reason)
