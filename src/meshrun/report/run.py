"""Read a run directory for `meshrun report`: rank 0's metrics.jsonl, every rank's step times, and
the failures and recoveries in events.jsonl.

A malformed line (typically the half-written last line of a crashed run) is skipped and counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.errors import MeshrunError
from meshrun.metrics.logger import METRICS_FILE, RANKS_DIR
from meshrun.report.recoveries import Recovery, find_recoveries, goodput_estimate
from meshrun.runtime import events

logger = logging.getLogger(__name__)


class ReportError(MeshrunError):
    """The run directory or its metrics cannot be read."""


STRAGGLER_EVENTS = ("straggler", "straggler_cleared")  # rows of their own, not run facts


@dataclass
class RunData:
    """What a run directory holds: rank 0's records and each rank's step times."""

    name: str
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    meta: dict[str, Any]
    ranks: dict[int, list[dict[str, Any]]]
    skipped_lines: int = 0
    starts: list[dict[str, Any]] = field(default_factory=list)
    """Each start's meta row, in order (the rows with "start_step": > 0 on a resume)."""
    recoveries: list[Recovery] = field(default_factory=list)
    """Each restart after a failure (events.jsonl), in order."""
    goodput: float | None = None
    """The goodput those recoveries left, estimated from this run's records (recoveries.py)."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """The trainer's live straggler rows (metrics/stragglers.py): named and cleared, in order."""

    @property
    def resumed_at(self) -> list[int]:
        """The steps the run resumed from (the checkpoint's step), in order."""
        return [r["start_step"] for r in self.starts
                if isinstance(r.get("start_step"), int) and not isinstance(r["start_step"], bool)
                and r["start_step"] > 0]


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a .jsonl file and how many non-empty lines were not one."""
    records, bad = [], 0
    with path.open(encoding="utf-8", errors="replace") as stream:
        for line in stream:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # typically the half-written last line of a crashed run
                continue
            if isinstance(record, dict) and (record.get("kind") == "meta" or isinstance(record.get("step"), int)):
                records.append(record)
            else:
                bad += 1
    return records, bad


def _by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sorted by step, keeping the last record of a step (a resumed run logs its steps again)."""
    return sorted({record["step"]: record for record in records}.values(), key=lambda r: r["step"])


def load_run(run_dir: str | Path) -> RunData:
    """Read runs/<name>/metrics.jsonl and ranks/*.jsonl; ReportError when there is nothing to show."""
    run_dir = Path(run_dir)
    if run_dir.is_file() and run_dir.name == METRICS_FILE:
        run_dir = run_dir.parent
    if not run_dir.exists():
        raise ReportError(f"run directory {run_dir} does not exist: pass the runs/<name> directory "
                          f"that `meshrun train` wrote")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory: pass a run directory such as runs/<name>")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{path} not found: {run_dir} is not a meshrun run directory "
                          f"(rank 0 writes {METRICS_FILE} during `meshrun train`)")
    records, bad = _read_jsonl(path)
    if not records and not bad:
        raise ReportError(f"{path} is empty: the run stopped before it logged its first step")
    kinds: dict[str, list[dict[str, Any]]] = {"train": [], "eval": [], "meta": []}
    for record in records:
        kind = record.get("kind") or ("eval" if "eval_loss" in record else "train")
        kinds.setdefault(kind, []).append(record)
    if not kinds["train"] and not kinds["eval"]:
        raise ReportError(f"{path} has no train or eval records ({bad} malformed lines skipped): "
                          f"expected one JSON object per line with a \"step\"")
    ranks = {}
    for rank_path in sorted((run_dir / RANKS_DIR).glob("rank*.jsonl")):
        suffix = rank_path.stem.removeprefix("rank")
        if suffix.isdigit():
            rows, rank_bad = _read_jsonl(rank_path)
            bad += rank_bad
            rows = [r for r in rows if isinstance(r.get("step_time_s"), (int, float))]
            if rows:
                ranks[int(suffix)] = _by_step(rows)
    if bad:
        logger.info("skipped %d malformed lines in %s", bad, run_dir)
    meta: dict[str, Any] = {}
    live = [r for r in kinds["meta"] if r.get("event") in STRAGGLER_EVENTS]
    for record in kinds["meta"]:
        if record.get("event") not in STRAGGLER_EVENTS:
            meta.update(record)
    recoveries = find_recoveries(events.read(run_dir), kinds["train"])
    return RunData(name=run_dir.resolve().name, train=_by_step(kinds["train"]),
                   eval=_by_step(kinds["eval"]), meta=meta, ranks=dict(sorted(ranks.items())),
                   skipped_lines=bad, starts=[r for r in kinds["meta"] if "start_step" in r],
                   recoveries=recoveries, goodput=goodput_estimate(recoveries, kinds["train"]), stragglers=live)
