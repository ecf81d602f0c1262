"""Opt-in per-sample log (`checkpoint.sample_log = true`): which data items each step consumed.

Each rank appends one JSON line per step to RUN/samples/rank-NNNNN.jsonl:
    {"session": S, "step": 7, "dp_rank": 0, "dp_size": 2, "samples": [[epoch, index], ...]}
`session` is the same on every rank of one start of the workers and grows with each start.
A step can appear more than once (steps after the last checkpoint are redone after a crash);
the entries of the latest session that ran it are the ones the final model saw, so an audit
keeps those (see `effective_samples`) and then checks that no (epoch, index) repeats.

The indices come from the loader's exact position before and after the step (the same
numbers a checkpoint stores) and the sampler's documented order, not from the batches.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.data.loader import InfiniteLoader

SAMPLES_DIR = "samples"


def _position(loader: InfiniteLoader) -> tuple[int, int]:
    state = loader.state_dict()
    return int(state["epoch"]), int(state["consumed"])


def consumed_between(loader: InfiniteLoader, start: tuple[int, int], end: tuple[int, int]) -> list[list[int]]:
    """[[epoch, index], ...] this rank took between two positions (strided as the sampler hands out)."""
    sampler, dataloader = loader.sampler, loader.dataloader
    n, replicas, rank = sampler.num_samples, sampler.num_replicas, sampler.rank
    out: list[list[int]] = []
    epoch, consumed = start
    while (epoch, consumed) < end:
        if epoch == end[0]:
            stop = end[1]
        else:  # the rest of the epoch this pass delivered: whole batches only, under drop_last
            per_rank = (n - consumed) // replicas
            if dataloader.drop_last and dataloader.batch_size:
                per_rank -= per_rank % dataloader.batch_size
            stop = consumed + per_rank * replicas
        order = sampler.epoch_order(epoch)[consumed:stop]
        out += [[epoch, int(i)] for i in order[rank::replicas].tolist()]
        epoch, consumed = epoch + 1, 0
    return out


class SampleLog:
    """Appends each step's consumed (epoch, index) pairs for this rank; a no-op when disabled."""

    def __init__(self, run_dir: Path, *, enabled: bool, rank: int, session: int, loader: InfiniteLoader):
        self.enabled = enabled and loader.sampler is not None
        self.loader, self.session = loader, session
        self._before: tuple[int, int] | None = None
        if self.enabled:
            directory = Path(run_dir) / SAMPLES_DIR
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"rank-{rank:05d}.jsonl"

    def begin_step(self) -> None:
        if self.enabled:
            self._before = _position(self.loader)

    def end_step(self, step: int) -> None:
        if not self.enabled or self._before is None:
            return
        sampler = self.loader.sampler
        row = {"session": self.session, "step": step, "dp_rank": sampler.rank, "dp_size": sampler.num_replicas,
               "samples": consumed_between(self.loader, self._before, _position(self.loader))}
        with open(self.path, "a") as fp:
            fp.write(json.dumps(row) + "\n")
        self._before = None


def effective_samples(run_dir: Path) -> dict[int, list[tuple[int, int]]]:
    """step -> the (epoch, index) pairs of the latest session that ran it, over all dp ranks."""
    rows = []
    for path in sorted((Path(run_dir) / SAMPLES_DIR).glob("rank-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    latest: dict[int, int] = {}
    for row in rows:
        latest[row["step"]] = max(latest.get(row["step"], row["session"]), row["session"])
    by_step: dict[int, dict[int, list]] = {}
    for row in rows:
        if row["session"] == latest[row["step"]]:  # TP/PP ranks of one dp rank log the same items
            by_step.setdefault(row["step"], {})[row["dp_rank"]] = [tuple(s) for s in row["samples"]]
    return {step: [s for rank in sorted(parts) for s in parts[rank]] for step, parts in sorted(by_step.items())}
