"""The metrics sink: rank 0's metrics.jsonl (and TensorBoard), and every rank's own step times.

Layout of a run directory:
    runs/<name>/metrics.jsonl        rank 0: {"kind": "train" | "eval" | "meta", "step": ..., ...}
    runs/<name>/ranks/rank<N>.jsonl  every rank: {"step", "step_time_s", "data_time_s"?, "compute_time_s"?,
                                     "peak_mem_bytes"?}
    runs/<name>/tb/                  TensorBoard event files, when `tensorboard` is installed
    runs/<name>/mlruns, wandb/, trackio/   the trackers `[metrics] trackers` names (metrics/trackers.py)

Files are only ever appended to (opened O_APPEND: no row is rewritten; a resumed or rolled-back run
continues them, and `meshrun report` keeps the last line of each step) and flushed after every
line, so a crash loses nothing that was logged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import IO, Any

from meshrun.metrics.tracker_adapters import TensorBoardTracker
from meshrun.metrics.tracker_base import flat_config
from meshrun.metrics.trackers import TrackerSet
from meshrun.runtime.diskfault import disk_fault, disk_write_error

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RANKS_DIR = "ranks"


def rank_file(run_dir: str | Path, rank: int) -> Path:
    """Where `rank` writes its per-step times."""
    return Path(run_dir) / RANKS_DIR / f"rank{rank}.jsonl"


def _open_append(path: Path) -> IO[str]:
    """Open for appending; if a crash left half a line at the end, start on a fresh line."""
    torn = False
    if path.is_file() and path.stat().st_size > 0:
        with path.open("rb") as existing:
            existing.seek(-1, 2)
            torn = existing.read(1) != b"\n"
    stream = path.open("a", encoding="utf-8")
    if torn:
        stream.write("\n")
    return stream


def _jsonable(value: Any) -> Any:
    """Plain numbers for JSON: tensors and numpy scalars via .item(); NaN/inf become null (strict JSON)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _open_tensorboard(run_dir: Path, config: dict[str, Any] | None) -> TensorBoardTracker | None:
    """TensorBoard when the `tensorboard` package is importable, else None with one info line."""
    if importlib.util.find_spec("tensorboard") is None:
        logger.info("tensorboard is not installed; metrics go to metrics.jsonl only "
                    "(pip install tensorboard to get event files)")
        return None
    try:
        return TensorBoardTracker.open(run_dir, None, flat_config(config or {}), run_dir.name)
    except Exception as exc:  # a broken install (protobuf mismatch, ...) must not stop training
        logger.info("tensorboard is installed but unusable (%s); metrics go to metrics.jsonl only", exc)
        return None


class MetricsLogger:
    """Writes training metrics. Safe to call on every rank: only rank 0 writes metrics.jsonl and
    TensorBoard; every rank writes its own ranks/rank<N>.jsonl through `log_rank_step`.

        with MetricsLogger(run_dir, rank=rank) as metrics:
            metrics.log_train(step, loss=loss, lr=lr, tokens_per_s=tps, step_time_s=dt)
            metrics.log_rank_step(step, step_time_s=dt)
            metrics.log_eval(step, eval_loss=val)
    """

    def __init__(self, run_dir: str | Path, *, rank: int, enabled_jsonl: bool = True,
                 tensorboard: bool = True, trackers: tuple[str, ...] = (),
                 config: dict[str, Any] | None = None) -> None:
        """tensorboard: TensorBoard when installed (best effort); trackers: those that must run
        (their libraries were checked before launch); config: {section: {key: value}} for them."""
        self.run_dir = Path(run_dir)
        self.rank = rank
        self._metrics: IO[str] | None = None
        self._rank_file: IO[str] | None = None
        self._trackers = TrackerSet([])
        self._meta: dict[str, Any] = {}
        self._last: dict[str, Any] = {}
        if enabled_jsonl:
            rank_file(self.run_dir, rank).parent.mkdir(parents=True, exist_ok=True)
            self._rank_file = _open_append(rank_file(self.run_dir, rank))
            if rank == 0:
                self._metrics = _open_append(self.run_dir / METRICS_FILE)
        if rank == 0:
            board = _open_tensorboard(self.run_dir, config) if (
                tensorboard and "tensorboard" not in trackers) else None
            self._trackers = TrackerSet.open(trackers, self.run_dir, config=config, extra=[board] if board else [])

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def log_train(self, step: int, *, loss: float, lr: float | None = None,
                  grad_norm: float | None = None, tokens_per_s: float | None = None,
                  step_time_s: float | None = None, peak_mem_bytes: int | None = None,
                  peak_mem_kind: str | None = None, mfu: float | None = None, **extra: Any) -> None:
        """One training record (rank 0 writes it; other ranks ignore the call). None fields are left out."""
        fields = dict(loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s,
                      step_time_s=step_time_s, peak_mem_bytes=peak_mem_bytes,
                      peak_mem_kind=peak_mem_kind, mfu=mfu, **extra)
        self._record("train", step, fields)

    def log_eval(self, step: int, *, eval_loss: float, **extra: Any) -> None:
        """One eval record, {"kind": "eval", "step", "eval_loss", ...} (rank 0 only)."""
        self._record("eval", step, dict(eval_loss=eval_loss, **extra))

    def log_meta(self, **fields: Any) -> None:
        """Facts about the run for the report (world_size, device, num_params, ...), rank 0 only.
        event="end" marks the run's end: the trackers get every meta fact and the final values as
        their summary."""
        if self._metrics is not None:
            self._write(self._metrics, {"kind": "meta", "time": round(time.time(), 3), **fields})
        if self.rank != 0:
            return
        self._meta.update({k: _jsonable(v) for k, v in fields.items() if k != "event" and v is not None})
        if fields.get("event") == "end":
            self._trackers.summary({**self._meta, **self._last}, int(self._last.get("steps", 0)))

    def log_rank_step(self, step: int, *, step_time_s: float, data_time_s: float | None = None,
                      compute_time_s: float | None = None, peak_mem_bytes: int | None = None) -> None:
        """This rank's own times for one step, on every rank: the report compares ranks.

        Synchronous steps take equally long on every rank (the fast wait for the slow inside
        the collective), so a straggler shows in rank-local times: `data_time_s` (waiting for
        the batch) and `compute_time_s` (work before the first blocking collective, e.g. the
        forward pass under DDP). When every rank logs compute_time_s the report ranks by those.
        `peak_mem_bytes` (every few steps is enough) gives the report each rank's peak memory.
        """
        if self._rank_file is not None:
            record = {"step": int(step), "step_time_s": step_time_s, "data_time_s": data_time_s,
                      "compute_time_s": compute_time_s, "peak_mem_bytes": peak_mem_bytes}
            self._write(self._rank_file, {k: v for k, v in record.items() if v is not None})

    def _record(self, kind: str, step: int, fields: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        reserved = {"kind", "step", "time"} & fields.keys()
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved by metrics.jsonl")
        values = {key: _jsonable(value) for key, value in fields.items() if value is not None}
        if self._metrics is not None:
            self._write(self._metrics, {"kind": kind, "step": int(step), "time": round(time.time(), 3),
                                        **values})
        self._trackers.log(kind, step, values)
        self._last["steps"] = max(int(step), int(self._last.get("steps", 0)))
        for key in ("loss", "eval_loss"):
            if isinstance(values.get(key), (int, float)):
                self._last[f"final_{key}"] = values[key]

    @staticmethod
    def _write(stream: IO[str], record: dict[str, Any]) -> None:
        try:
            stream.write(json.dumps({key: _jsonable(value) for key, value in record.items()}) + "\n")
            stream.flush()  # to the OS on every line: a crashed run keeps every line it logged
        except OSError as exc:  # a full or read-only disk: one line that names the file, not a traceback
            if disk_fault(exc) is None:
                raise
            raise disk_write_error(exc, stream.name, what="a metrics row",
                                   after="the run stops; its last checkpoint is intact") from None

    def flush(self) -> None:
        for stream in (self._metrics, self._rank_file):
            if stream is not None:
                stream.flush()
        self._trackers.flush()

    def close(self) -> None:
        """Close every file; later log calls do nothing. Safe to call twice."""
        for stream in (self._metrics, self._rank_file):
            if stream is not None:
                with contextlib.suppress(OSError):  # a line a full disk refused, still buffered
                    stream.close()
        self._trackers.close()
        self._metrics = self._rank_file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
