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

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshrun.metrics.tracker_base import Tracker, TrackerState, flat_config, numeric

logger = logging.getLogger(__name__)


def _openers() -> dict[str, Any]:
    from meshrun.metrics import tracker_adapters as adapters

    return {"tensorboard": adapters.TensorBoardTracker.open, "mlflow": adapters.MlflowTracker.open,
            "wandb": adapters.WandbTracker.open, "trackio": adapters.TrackioTracker.open}


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
