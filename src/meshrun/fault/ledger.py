"""The data ledger of a torchft run: which samples every committed step consumed, and by whom.

Every replica group's local rank 0 appends one row per committed step to
`<run dir>/torchft/ledger-g<group>.jsonl`: the step, the groups in its quorum, and the slice of
the epoch's global sample order the step consumed, `[pos0, pos1)` of epoch `epoch`
(meshrun.data.sampler: one order per epoch, one position for all ranks). Heals and worker
starts go to `events.jsonl` there. `account()` reads them back (torch-free) and says whether
the committed steps tile each epoch's order from 0 with no gap and no overlap, i.e. whether every
sample was seen exactly once; a gap or overlap is listed by epoch and position.

A step that runs past the end of an epoch takes that epoch's samples only up to `end0`
(`epoch_end_taken`): the sampler and the DataLoader both drop what fills no whole batch on every
rank, so the epoch's last few positions `[end0, epoch_end)` are skipped in that epoch (by any
run, exact mode too: later epochs reshuffle them in). `account()` lists them apart, as dropped,
neither lost nor seen.

A step that two lineages committed (a group committed it, then died, and the survivor, which had
not, committed it again with a smaller quorum) keeps the last row: the survivor's state is the
one later steps build on. A process that heals from a peer throws its whole state away, so the
rows it wrote before that heal are discarded (`discarded`): e.g. a restarted group that formed a
quorum by itself while a stalled survivor's heartbeat had lapsed, stepped from step 0, then
healed to the survivor's step. Its quorum partners' rows of the same steps stay.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

LEDGER_GLOB = "ledger-g*.jsonl"
EVENTS_FILE = "events.jsonl"


def append_row(path: Path, row: dict) -> None:
    """One JSON line, written with a single O_APPEND write so rows of several writers never mix."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def record_event(records: Path, event: str, **fields) -> None:
    append_row(records / EVENTS_FILE, {"event": event, "time": round(time.time(), 4), "pid": os.getpid(), **fields})


def epoch_end_taken(before: dict, batch_size: int) -> int:
    """Where a step that ran past its epoch's end stopped taking that epoch's samples.

    `before`: the loader's state at the step's start (meshrun.data.sampler's format). From global
    position pos0, each of the R ranks gets floor((n - pos0) / R) more items of the epoch (the
    sampler drops the rest, drop_last) and the DataLoader delivers whole batches of them only
    (drop_last), so the ranks take R * b * floor(floor((n - pos0) / R) / b) more positions, in lock
    step; [that, n) is never delivered. The same holds from the pass's start, whose delivered
    batches are whole: pos0 - start is a multiple of R * b."""
    n, pos0, ranks = before["num_samples"], before["consumed"], before["num_replicas"]
    return pos0 + ranks * batch_size * ((n - pos0) // ranks // batch_size)


def ledger_path(records: Path, group: int) -> Path:
    return records / f"ledger-g{group}.jsonl"


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a writer killed mid-line: the rest of the file still counts
            continue
    return rows


def read_ledgers(records: Path) -> list[dict]:
    return [row for path in sorted(records.glob(LEDGER_GLOB)) for row in _read_jsonl(path)]


def read_events(records: Path) -> list[dict]:
    path = records / EVENTS_FILE
    return _read_jsonl(path) if path.exists() else []


@dataclass
class Accounting:
    """What the committed steps consumed, per epoch, and what went wrong with it."""

    steps: int = 0  # distinct committed steps
    samples: int = 0  # positions covered, over all epochs
    covered: dict[int, int] = field(default_factory=dict)  # epoch -> end of its covered prefix
    gaps: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, start, end): never committed
    overlaps: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, start, end): committed twice
    dropped: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, start, end): an epoch's tail, no whole batch
    superseded: int = 0  # rows of a step replaced by a later commit of it
    by_group: dict[int, int] = field(default_factory=dict)  # group -> steps it committed
    alone: dict[int, int] = field(default_factory=dict)  # group -> steps committed with a smaller quorum
    discarded: int = 0  # rows of a process written before it healed: a lineage no later step builds on
    weights_compared: int = 0  # steps two or more groups fingerprinted (after a quorum change or heal)
    weights_differ: list[int] = field(default_factory=list)  # ... whose fingerprints differed

    @property
    def exact(self) -> bool:
        return not self.gaps and not self.overlaps


def _pieces(row: dict) -> list[tuple[int, int, int]]:
    """A step's slices (epoch, start, end); one that ran past an epoch's end has two (a row without
    end0, of an older meshrun, counts that epoch's tail as taken)."""
    if row["epoch0"] == row["epoch1"]:
        return [(row["epoch0"], row["pos0"], row["pos1"])]
    return [(row["epoch0"], row["pos0"], row.get("end0", row["epoch_end"])), (row["epoch1"], 0, row["pos1"])]


def _tail(row: dict) -> tuple[int, int, int] | None:
    """The positions of its first epoch that a step running past the epoch's end skipped."""
    if row["epoch0"] == row["epoch1"] or row.get("end0", row["epoch_end"]) >= row["epoch_end"]:
        return None
    return row["epoch0"], row["end0"], row["epoch_end"]


def discarded_by_heals(rows: list[dict], events: list[dict]) -> list[dict]:
    """The rows a heal threw away: those a (group, pid) wrote before its last heal (module doc)."""
    healed: dict[tuple[int, int], float] = {}
    for event in events:
        if event.get("event") == "heal":
            key = (event["group"], event["pid"])
            healed[key] = max(healed.get(key, event["time"]), event["time"])
    return [row for row in rows if row["time"] < healed.get((row["group"], row["pid"]), float("-inf"))]


def account(rows: list[dict], num_groups: int | None = None, events: list[dict] = ()) -> Accounting:
    """Check that the committed steps of `rows` tile every epoch's order once (see the module doc);
    `events` (heals) say which rows a heal discarded."""
    result = Accounting()
    for row in rows:  # what each group committed, kept or not
        result.by_group[row["group"]] = result.by_group.get(row["group"], 0) + 1
        if num_groups and row["participants"] < num_groups:
            result.alone[row["group"]] = result.alone.get(row["group"], 0) + 1
    thrown = {id(row) for row in discarded_by_heals(rows, list(events))}
    result.discarded = len(thrown)
    rows = [row for row in rows if id(row) not in thrown]
    last: dict[int, dict] = {}
    for row in sorted(rows, key=lambda r: r["time"]):
        previous = last.get(row["step"])
        if previous is not None and _pieces(previous) != _pieces(row):
            result.superseded += 1
        last[row["step"]] = row
    result.steps = len(last)
    sums: dict[int, set[float]] = {}
    for row in rows:
        if "weights_sum" in row:
            sums.setdefault(row["step"], set()).add(row["weights_sum"])
    fingerprinted = [step for step in sums if sum(1 for r in rows if r["step"] == step and "weights_sum" in r) > 1]
    result.weights_compared = len(fingerprinted)
    result.weights_differ = sorted(step for step in fingerprinted if len(sums[step]) > 1)
    spans: dict[int, list[tuple[int, int]]] = {}
    for row in last.values():
        for epoch, start, end in _pieces(row):
            spans.setdefault(epoch, []).append((start, end))
        tail = _tail(row)
        if tail is not None:
            result.dropped.append(tail)
    for epoch, pieces in sorted(spans.items()):
        reach = 0
        for start, end in sorted(pieces):
            if start > reach:
                result.gaps.append((epoch, reach, start))
            elif start < reach:
                result.overlaps.append((epoch, start, min(end, reach)))
            reach = max(reach, end)
            result.samples += end - start
        result.covered[epoch] = reach
    return result


def describe(acc: Accounting) -> str:
    """One line for the end summary."""
    where = ", ".join(f"epoch {e}: positions 0-{end}" for e, end in sorted(acc.covered.items()))
    if acc.dropped:  # not a loss: the sampler's and DataLoader's drop_last, as in any run
        where += "; an epoch's last positions that fill no whole batch, skipped in it: " + ", ".join(
            f"epoch {e} [{a}, {b})" for e, a, b in sorted(acc.dropped))
    weights = (f"; weights equal across groups at {acc.weights_compared} checked step(s)" if not acc.weights_differ
               else f"; weights DIFFER across groups at steps {acc.weights_differ}")
    if acc.discarded:
        weights += f"; {acc.discarded} step(s) a group committed before it healed from a peer, discarded with its state"
    if acc.exact:
        return (f"data: {acc.steps} committed steps consumed {acc.samples} samples, each exactly once ({where})"
                + weights)
    parts = []
    if acc.gaps:
        parts.append("never committed (lost): " + ", ".join(f"epoch {e} [{a}, {b})" for e, a, b in acc.gaps))
    if acc.overlaps:
        parts.append("committed twice: " + ", ".join(f"epoch {e} [{a}, {b})" for e, a, b in acc.overlaps))
    return f"data: {acc.steps} committed steps; " + "; ".join(parts) + weights
