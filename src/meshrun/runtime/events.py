"""Timestamped lifecycle events of a run's workers, for measuring recoveries: `<run dir>/events.jsonl`.

    record(run_dir, "pg_ready")          # one JSON line: time, event, rank, attempt, pid, ...
    rows = read(run_dir)

Every rank appends whole lines (one small write each, O_APPEND), a few per start of the workers,
never per step. `benchmarks/goodput.py` and the tests read them to split a recovery into its
parts; metrics.jsonl keeps the per-step times. Standard library only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"


def record(run_dir: str | Path, event: str, **fields) -> None:
    """Append one event line; an unwritable run directory only loses the event."""
    row = {"time": round(time.time(), 4), "event": event, "rank": int(os.environ.get("RANK", "0")),
           "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": os.getpid(), **fields}
    try:
        fd = os.open(Path(run_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read(run_dir: str | Path) -> list[dict]:
    """Every well-formed event line, in file order (a torn last line is skipped)."""
    rows = []
    try:
        text = (Path(run_dir) / EVENTS_FILE).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "event" in row and "time" in row:
            rows.append(row)
    return rows


def process_start_time(pid: int | str = "self") -> float | None:
    """Wall-clock time a process started (Linux /proc, 10 ms resolution); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        now, uptime = time.time(), float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    # btime in /proc/stat has whole seconds only; uptime has centiseconds
    return now - uptime + ticks / os.sysconf("SC_CLK_TCK")
