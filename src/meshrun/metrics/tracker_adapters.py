"""The tracker adapters `meshrun.metrics.trackers` opens, each writing locally by default.

- TensorBoard: event files in runs/<name>/tb.
- MLflow: `MLFLOW_TRACKING_URI` when the user set it, else a file store in runs/<name>/mlruns
  (mlflow 3 keeps file stores in maintenance mode: meshrun opts in for that store only; a
  sqlite:// store needs sqlalchemy and alembic, which mlflow-skinny leaves out).
- W&B: offline into runs/<name>/wandb (`wandb sync` uploads it later), unless WANDB_MODE is set
  or the user is logged in (WANDB_API_KEY, or a netrc entry for the W&B host).
- trackio: its SQLite database in runs/<name>/trackio unless TRACKIO_DIR is set; no server, no UI.

Experiment/project: "meshrun" unless MLFLOW_EXPERIMENT_NAME / WANDB_PROJECT say otherwise.
"""

from __future__ import annotations

import contextlib
import io
import logging
import netrc
import os
import secrets
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from meshrun.metrics.tracker_base import PROJECT, TENSORBOARD_DIR, TrackerState, numeric

logger = logging.getLogger(__name__)

MLFLOW_PARAM_CHARS = 6000  # mlflow's limit for one param value


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


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """`name=value` in os.environ for the block only, unless the user set it (to a non-empty value)."""
    before = os.environ.get(name)
    if before:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class MlflowTracker:
    name = "mlflow"

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def open(cls, run_dir: Path, state: TrackerState, config: dict[str, Any], run_name: str) -> MlflowTracker:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        with _env("MLFLOW_ALLOW_FILE_STORE", "true"):  # the store is built (and cached) here
            client = MlflowClient(tracking_uri=uri)
        run_id, logged = state.get("mlflow_run_id"), {}
        if run_id is not None:
            try:  # a resumed run: continue the same MLflow run
                run = client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
                logged = run.data.params
            except Exception:  # noqa: BLE001 - gone (another store, deleted): start a new one
                run_id = None
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
            run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
            state.put("mlflow_run_id", run_id)
        tracker = cls(client, run_id)
        tracker._log_params({k: v for k, v in config.items() if k not in logged})  # params never change
        return tracker

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.log({f"summary/{k}": v for k, v in numeric(values).items()}, step)
        for key, value in values.items():
            self.client.set_tag(self.run_id, f"summary.{key}", str(value)[:MLFLOW_PARAM_CHARS])

    def flush(self) -> None:
        pass  # every call is written when it returns

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def wandb_logged_in() -> bool:
    """An API key in the environment, or a netrc entry for the W&B host (no network, no wandb import)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def open(cls, run_dir: Path, state: TrackerState, config: dict[str, Any], run_name: str) -> WandbTracker:
        import wandb

        mode = None if os.environ.get("WANDB_MODE") or wandb_logged_in() else "offline"
        run_id = state.get("wandb_id") or secrets.token_hex(8)
        state.put("wandb_id", run_id)
        run = wandb.init(project=None if os.environ.get("WANDB_PROJECT") else PROJECT, name=run_name,
                         id=run_id, resume="allow", dir=str(run_dir), config=config, mode=mode,
                         settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        logger.info("wandb: %s run %s in %s", mode or "online", run_id, run_dir / "wandb")
        return cls(run)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.run.summary.update(values)

    def flush(self) -> None:
        pass  # the run's own process writes as it goes

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    name = "trackio"

    def __init__(self, module: Any, run: Any) -> None:
        self.module, self.run = module, run

    @classmethod
    def open(cls, run_dir: Path, state: TrackerState, config: dict[str, Any], run_name: str) -> TrackioTracker:
        where = str((run_dir / "trackio").resolve())
        with _env("TRACKIO_DIR", where):  # trackio reads it once, at import
            import trackio
        actual = str(trackio.utils.TRACKIO_DIR)
        if actual != where and not os.environ.get("TRACKIO_DIR"):
            logger.info("trackio was imported before meshrun set its directory; it writes to %s", actual)
        with contextlib.redirect_stdout(io.StringIO()):  # its banner and dashboard hints
            run = trackio.init(project=PROJECT, name=run_name, config=config, resume="allow", embed=False,
                               auto_log_cpu=False, auto_log_gpu=False)
        return cls(trackio, run)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.log({f"summary/{k}": v for k, v in numeric(values).items()}, step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.module.finish()  # finishes our run and forgets it (no second finish at exit)
