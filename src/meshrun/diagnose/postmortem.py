"""`meshrun diagnose`: read a failed run's per-rank logs and say what happened first, and the fix.

A log root is what `meshrun launch --log-dir` (or `meshrun train`'s RUN_DIR/logs) holds:
`<run id>/attempt_N/<local rank>/{stdout.log,stderr.log,error.json}`, plus failures.json
written by the launcher with each rank's exit code or signal. Each rank is read into the
launcher's own failure type (launch/failure.py: the same reading, ordering and wording as the
launch summary) and classified by diagnose/classify.py.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from dataclasses import dataclass, field

from meshrun.diagnose.classify import DATA, FOLLOW_ON, classify_failure, classify_launch
from meshrun.errors import MeshrunError
from meshrun.launch.failure import (
    ERROR_FILE,
    RankFailure,
    clip,
    is_follow_on,
    order_by_cause,
    read_error_file,
)
from meshrun.launch.summary import FAILURES_FILE, LAUNCH_ERROR_FILE


@dataclass
class RankReport(RankFailure):
    """A rank's failure (the launcher's own type) plus what diagnose concludes from it."""

    kind: str = ""
    fix: str = ""
    failed: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def signal(self) -> str | None:
        return self.signal_name

    def to_json(self) -> dict:
        return {**super().to_json(), "kind": self.kind, "fix": self.fix, "failed": self.failed,
                "warnings": list(self.warnings)}


@dataclass
class Diagnosis:
    log_root: str
    run: str
    attempt: int
    attempts: int
    ranks: list[RankReport]
    first: RankReport | None

    def to_json(self) -> dict:
        return {"log_root": self.log_root, "run": self.run, "attempt": self.attempt, "attempts": self.attempts,
                "classification": self.first.kind if self.first else None,
                "first_failure": self.first.to_json() if self.first else None,
                "fix": self.first.fix if self.first else None,
                "timeline": timeline(self), "ranks": [r.to_json() for r in self.ranks]}


def find_log_root(path: str) -> str:
    """The directory holding <run>/attempt_N/: PATH itself, or PATH/logs (a `meshrun train` run dir)."""
    for candidate in (path, os.path.join(path, "logs")):
        if glob.glob(os.path.join(candidate, "*", "attempt_*", "*")):
            return candidate
    raise MeshrunError(f"{path!r} holds no rank logs (<run>/attempt_N/<rank>/); give a `meshrun train` run "
                       f"directory or a `meshrun launch --log-dir` directory")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fp:
            return fp.read()
    except OSError:
        return ""


def _rank_report(rank_dir: str, agent: dict) -> RankReport:
    local_rank = int(os.path.basename(rank_dir))
    stderr = _read(os.path.join(rank_dir, "stderr.log"))
    stdout = _read(os.path.join(rank_dir, "stdout.log"))
    report = RankReport(rank=-1, local_rank=local_rank, log_dir=rank_dir)
    report.read_error_data(read_error_file(os.path.join(rank_dir, ERROR_FILE)))
    if report.exc_type is None:
        report.read_exception_from_log(stderr.splitlines())
    if report.rank < 0:
        report.rank = local_rank
    report.failed = report.exc_type is not None
    if agent:
        report.failed = True
        report.exitcode, report.pid = agent.get("exitcode"), int(agent.get("pid") or 0)
        report.host = agent.get("host")
        report.time = report.time or agent.get("time")
    if report.time is None:
        mtimes = [os.path.getmtime(p) for p in glob.glob(os.path.join(rank_dir, "*.log"))]
        report.time = max(mtimes) if mtimes else None
    report.warnings = [line.strip() for line in (stdout + stderr).splitlines() if "meshrun: data warning" in line]
    report.follow_on = report.failed and is_follow_on(report)
    kind = classify_failure(report, stderr)
    if not report.failed and report.warnings:
        kind = DATA
    report.kind, report.fix = kind.name, kind.fix
    if report.hint:
        report.fix = report.hint  # meshrun's explanation of this exact torch error
    return report


def _launch_error(path: str) -> tuple[str, dict] | None:
    """(log root, record) of a failure before any worker ran, from launch_error.json."""
    for candidate in (path, os.path.join(path, "logs")):
        try:
            record = json.loads(_read(os.path.join(candidate, LAUNCH_ERROR_FILE)) or "null")
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("message"):
            return candidate, record
    return None


def _launch_diagnosis(root: str, record: dict) -> Diagnosis:
    kind = classify_launch(str(record["message"]))
    report = RankReport(rank=-1, local_rank=-1, host=record.get("host"), time=record.get("time"),
                        exc_type="LaunchError", exc_text=str(record["message"]), kind=kind.name,
                        fix=kind.fix, failed=True, log_dir=root)
    return Diagnosis(root, f"launch ({record.get('stage', 'preflight')})", 0, 0, [report], report)


def diagnose(path: str) -> Diagnosis:
    """Read the newest run under PATH, its last attempt, every rank; or the launcher's own failure."""
    launch = _launch_error(path)
    try:
        root = find_log_root(path)
    except MeshrunError:
        if launch is None:
            raise
        return _launch_diagnosis(*launch)
    newest_attempt = max(os.path.getmtime(p) for p in glob.glob(os.path.join(root, "*", "attempt_*")))
    if launch is not None and float(launch[1].get("time") or 0) > newest_attempt:
        return _launch_diagnosis(*launch)  # the latest launch never got as far as its workers
    runs = sorted(glob.glob(os.path.join(root, "*", "attempt_*")), key=os.path.getmtime)
    run_dir = os.path.dirname(runs[-1])
    attempts = sorted(glob.glob(os.path.join(run_dir, "attempt_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
    last = attempts[-1]
    agent = {}
    try:
        rows = json.loads(_read(os.path.join(root, FAILURES_FILE)) or "{}").get("failures", [])
        agent = {int(r["local_rank"]): r for r in rows if str(r.get("log_dir") or "").startswith(last)}
    except (ValueError, KeyError, TypeError):
        pass
    ranks = [_rank_report(d, agent.get(int(os.path.basename(d)), {}))
             for d in sorted(glob.glob(os.path.join(last, "*")), key=lambda p: os.path.basename(p))
             if os.path.basename(d).isdigit()]
    ranks.sort(key=lambda r: r.rank)
    failed = [r for r in ranks if r.failed]
    ordered = order_by_cause(failed)
    first = ordered[0] if ordered else next((r for r in ranks if r.warnings), None)
    if first is not None and (first.follow_on or first.kind == FOLLOW_ON.name):  # all ranks only reacted
        first.fix = blame(first, ranks) + ("" if first.kind == FOLLOW_ON.name else f"; {first.fix}")
    return Diagnosis(root, os.path.basename(run_dir), int(last.rsplit("_", 1)[1]), len(attempts), ranks, first)


_RANK_NAMED = re.compile(r"\brank (\d+)\b")


def blame(first: RankReport, ranks: list[RankReport]) -> str:
    """The fix for a first failure that is only a consequence: the rank it is a consequence of.

    Every rank that recorded a failure only reacted to a peer, so the cause is a rank that left
    no error of its own: one the report names (the hang watchdog names the rank not in the
    collective, the collective checker the rank that never arrived), else one that ended
    without a Python error (killed, or exited while its peers still needed it).
    """
    others = {r.rank: r for r in ranks if r is not first}
    named = [int(n) for n in _RANK_NAMED.findall(first.exc_text or "") if int(n) in others]
    silent = [r.rank for r in others.values() if not r.raised]
    culprit = next(iter(named), None)
    if culprit is None and silent:
        culprit = silent[0]
    if culprit is None:
        return ("no rank here recorded the cause: it is on another node (run `meshrun diagnose` on that "
                "node's logs) or a node left")
    peer = others[culprit]
    if peer.failed and peer.signal_name:
        how = f"it was {peer.status} without a Python error (the OOM killer? check `dmesg`)"
    elif peer.failed:
        how = f"it ended with {peer.status}"
    else:
        how = "it recorded no error: it exited, or stopped answering, while its peers still needed it"
    where = f"; its output: {peer.log_dir}/stderr.log" if peer.log_dir else ""
    return f"rank {culprit} caused this: {how}{where}"


def timeline(diag: Diagnosis) -> list[dict]:
    """Each rank's failure (or last output) in time order, relative to the earliest."""
    events = [r for r in diag.ranks if r.time]
    if not events:
        return []
    t0 = min(r.time for r in events)
    rows = []
    for r in sorted(events, key=lambda r: r.time):
        if r.failed:
            what = r.describe(who=False)
        else:
            what = "last output (no failure recorded)"
        rows.append({"t": round(r.time - t0, 3), "clock": time.strftime("%H:%M:%S", time.localtime(r.time)),
                     "rank": r.rank, "event": what, "kind": r.kind})
    return rows


def format_diagnosis(diag: Diagnosis) -> str:
    if diag.attempts == 0:
        head = f"meshrun diagnose: {diag.log_root} ({diag.run}: no worker started)"
    else:
        head = (f"meshrun diagnose: {diag.log_root} (run {diag.run}, attempt {diag.attempt + 1} of "
                f"{diag.attempts}, {len(diag.ranks)} rank(s))")
    lines = [head, "timeline:"]
    for row in timeline(diag):
        who = "launcher" if row["rank"] < 0 else f"rank {row['rank']}"
        lines.append(f"  {row['clock']} +{row['t']:6.2f}s  {who}: {clip(row['event'], 160)}")
    first = diag.first
    if first is None:
        lines.append("no rank failed and no warning was found: the run looks healthy")
        return "\n".join(lines)
    where = f" on {first.host}" if first.host else ""
    if first.rank < 0:
        lines.append(f"first failure: the launcher{where}, before any worker started")
    else:
        lines.append(f"first failure: rank {first.rank} (local rank {first.local_rank}{where})")
    if first.exc_type:
        lines.append(f"  {first.exc_type}: {first.exc_text}")
    if first.site:
        lines.append(f"  at {first.site}")
    if first.signal or first.exitcode not in (None, 1):
        lines.append(f"  {first.status}")
    lines.append(f"classification: {first.kind}")
    lines.append(f"fix: {first.fix}")
    rest = [r for r in diag.ranks if r is not first and r.failed]
    if rest:
        lines.append("then, on the other ranks:")
        for r in rest:
            label = "consequence" if r.follow_on or r.kind == FOLLOW_ON.name else r.kind
            lines.append(f"  rank {r.rank} ({label}): {clip(r.describe(who=False), 160)}")
    warnings = [w for r in diag.ranks for w in r.warnings]
    if warnings and first.kind != DATA.name:
        lines.append(f"warnings: {warnings[0]}" + (f" (+{len(warnings) - 1} more)" if len(warnings) > 1 else ""))
    if first.rank < 0:
        lines.append(f"record: {os.path.join(diag.log_root, LAUNCH_ERROR_FILE)}")
    else:
        lines.append(f"logs: {os.path.join(diag.log_root, diag.run)}/attempt_{diag.attempt}/<local_rank>/stderr.log")
    return "\n".join(lines)
